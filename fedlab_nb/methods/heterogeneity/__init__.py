"""Algorithms for heterogeneous clients: FedProx, SCAFFOLD, FedNova, FedOpt (FedAdam, FedYogi, FedAdagrad),
FedAvgM, MOON, FedDyn, FedBN, q-FFL, FedLD and FedFTG.

The lesson `heterogeneity` of `fedlab_nb.repro.course.LESSONS`. One file per method (named after the method or its
paper id); each registers itself on import, and `fedlab_nb.methods` imports every module of every chapter."""
