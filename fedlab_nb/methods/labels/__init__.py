"""Scarce labels, unseen classes, new domains and mixed hardware: FedLabel, FedOSSL, FedKA (with its MMD
helpers), FedINS and ProWD (with its quantisation helpers).

The lesson `labels` of `fedlab_nb.repro.course.LESSONS`. One file per method (named after the method or its
paper id); each registers itself on import, and `fedlab_nb.methods` imports every module of every chapter."""
