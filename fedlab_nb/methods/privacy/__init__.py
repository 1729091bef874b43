"""Privacy: what leaks, and what protects: DP clipping and noise with a real accountant (`dp`, `accounting`),
DP-FedAvg, secure aggregation, gradient inversion, CPA, CPDA, aggregate responses and FedSVD.

The lesson `privacy` of `fedlab_nb.repro.course.LESSONS`. One file per method (named after the method or its
paper id); each registers itself on import, and `fedlab_nb.methods` imports every module of every chapter."""
