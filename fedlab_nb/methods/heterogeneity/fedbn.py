"""FedBN — Li, Jiang, Zhang, Kamp, Dou, "FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization", ICLR 2021. Official code: https://github.com/med-air/FedBN

FedAvg on every parameter except the BatchNorm layers: their affine parameters (γ, β) and their running
statistics (mean, variance, batch count) stay on the client. Checked against the official code: the
server averages every state_dict entry whose key does not contain "bn" (the BN layers are named bn*), so
`bn=("*bn*",)` here, with the BN models `make_model("mlp_bn" | "cnn_bn")`, whose BN modules are named so.

The γ, β of client k live in its store row "local"; its running statistics in "buffers"
(`ClientUpdate.local_buffers`), loaded into the BN layers while it trains and when its personal model
(θ with its own γ, β and statistics) is evaluated on its own test split. Runs on the loop backend only:
BatchNorm updates its running statistics in place, which vmap cannot batch (the engine falls back)."""
from __future__ import annotations

from ...core.groups import ParamGroups
from ...core.method import ClientUpdate, DataSizeWeighting, LocalObjective, Method, ServerSGD, weighted_mean
from ...core.registry import register
from ..heads import as_patterns


class FedBNClient(ClientUpdate):
    """The default client update, with the model's buffers (BN running statistics) kept per client."""
    local_buffers = True


@register("fedbn", claims="fedbn")
def fedbn(bn=("*bn*",), server_lr: float = 1.0) -> Method:
    """`bn`: glob patterns of the BatchNorm parameters kept local (default: every tensor of a module named *bn*)."""
    return Method("fedbn", LocalObjective(), DataSizeWeighting(), weighted_mean, ServerSGD(lr=server_lr),
                  groups=ParamGroups(local=as_patterns(bn)), client=FedBNClient())
