"""ClientApp: the fedlab_nb method's local objective and local SGD on this SuperNode's client
(node config partition-id); per-client state (SCAFFOLD's c_k) stays in this node's context.state."""
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from .task import apps

app = ClientApp()


@app.query()
def query(msg: Message, context: Context) -> Message:
    return apps(context.run_config)[1](msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return apps(context.run_config)[1](msg, context)
