"""Aggregation beyond federated training: weight-space ensembles and merges, output ensembles and voting with
certificates, gradient aggregation for many objectives, and distributed estimation and private aggregation.

None of these methods is federated learning proper; each teaches an aggregation primitive FL relies on, and
its notebook ties it back to the FL chapters. They build on `fedlab_nb.merging` (task vectors, the shared
merge baselines, calibration metrics).

The lesson `beyond` of `fedlab_nb.repro.course.LESSONS`. One file per method (named after the method or its
paper id); each registers itself on import, and `fedlab_nb.methods` imports every module of every chapter."""
