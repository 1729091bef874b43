"""Byzantine clients and robust aggregation: the one home of robust rules (`rules`: pure functions on
stacked [n, d] updates), stateful rules, worker momentum and the attack runner (`robust_aggregation`),
message attacks (`attacks`), data poisoning (`poison`), backdoors and the papers FedCPA, FLIP and FRL.

The lesson `robustness` of `fedlab_nb.repro.course.LESSONS`. One file per method (named after the method or its
paper id); each registers itself on import, and `fedlab_nb.methods` imports every module of every chapter."""
