"""ServerApp: the fedlab_nb method's sampling, aggregation, server optimiser and evaluation."""
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from .task import apps

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    server_app, _ = apps(context.run_config)
    server_app(grid, context)
