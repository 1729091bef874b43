"""Bilevel federated optimisation: hypergradients (unrolled, truncated, implicit), penalty methods, warm vs
cold start, and the federated (FedMBO) and decentralised (DSBO) algorithms built on them.

Everything here is plain `torch.func` on flat parameter vectors, so the same functions serve a
single-machine toy with a closed-form answer and a client's inner loop.

The lesson `bilevel` of `fedlab_nb.repro.course.LESSONS`. One file per method (named after the method or its
paper id); each registers itself on import, and `fedlab_nb.methods` imports every module of every chapter."""
