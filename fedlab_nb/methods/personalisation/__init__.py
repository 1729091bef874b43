"""Personalised federated learning: the baselines (local only, FedAvg-FT, Ditto, pFedMe, Per-FedAvg, FedPer,
LG-FedAvg, FedRep, FedBABU), FedALA, FedFomo, FedProto, FedRoD, clustered FL (CFL, IFCA), APFL, Self-FL,
PGFed, FedSelect, InCo (with its heterogeneous-depth models), FedLoGe, FOT, GGEUR and FED-PUB (with its
graph helpers).

The lesson `personalisation` of `fedlab_nb.repro.course.LESSONS`. One file per method (named after the method or its
paper id); each registers itself on import, and `fedlab_nb.methods` imports every module of every chapter."""
