"""FedBABU — Oh, Kim, Yun, "FedBABU: Toward Enhanced Representation for Federated Image Classification",
ICLR 2022. Official code: https://github.com/jhoon-oh/FedBABU

During federated training the head (classifier) stays frozen at its random initialisation: clients train
and send only the body, and the server averages the body (FedAvg). At evaluation every client fine-tunes
the *whole* model — body and head at the same lr — on its own training data, and that is its personal
model. Checked against the official code: training with `--local_upt_part body --aggr_part body`, and
personalisation in `analysis.ipynb` fine-tunes both body and head parameters for 5 epochs
(`personalization_epoch = 5`), hence `epochs=5` here; `finetune="head"` fine-tunes the head only."""
from __future__ import annotations

from ...core.registry import register
from ...core.method import DataSizeWeighting, LocalObjective, Method, ServerSGD, weighted_mean
from .fedavg_ft import FineTuneClient, check_finetune
from ..heads import BODY, HEAD, HeadSplit, as_patterns


@register("fedbabu", claims="personalisation_baselines")
def fedbabu(head=None, epochs: int | None = 5, steps: int | None = None, finetune: str = "full",
            server_lr: float = 1.0) -> Method:
    """`head`: glob patterns of the classifier (None: the last layer); fine-tuning `epochs` (or `steps`);
    `finetune`: "full" (the paper) or "head"."""
    if finetune not in ("full", "head"):
        raise ValueError(f"FedBABU's finetune must be 'full' or 'head', got {finetune!r}")
    check_finetune(steps, epochs)
    head = as_patterns(head)
    which = None if finetune == "full" else HeadSplit(frozen=(BODY,), head=head)
    return Method("fedbabu", LocalObjective(), DataSizeWeighting(), weighted_mean, ServerSGD(lr=server_lr),
                  groups=HeadSplit(frozen=(HEAD,), head=head), client=FineTuneClient(steps, epochs, which))
