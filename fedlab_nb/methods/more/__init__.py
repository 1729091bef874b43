"""Fairness, incentives, adversarial training and decentralised learning: AgLFOP (with its fairness measures),
FAL (with its adversarial-example helpers), DP-robust aggregation, Fair-BFL and VRA-DGT.

The lesson `more` of `fedlab_nb.repro.course.LESSONS`. One file per method (named after the method or its
paper id); each registers itself on import, and `fedlab_nb.methods` imports every module of every chapter."""
