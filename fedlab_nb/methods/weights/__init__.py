"""Aggregation weights and participation: AFL, FedAU, FedDisco, IDA, LDAWA, FedLAW, FedGP, FedCE and the
chapter's comparison of weighting rules (aggregation_weights).

The lesson `weights` of `fedlab_nb.repro.course.LESSONS`. One file per method (named after the method or its
paper id); each registers itself on import, and `fedlab_nb.methods` imports every module of every chapter."""
