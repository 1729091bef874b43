"""Communication and one-shot aggregation: compressed updates (top-k, rand-k, QSGD, signSGD, EF-signSGD,
PowerSGD: transforms usable with any method), FeRRet, FedPara, FedSA-LoRA, Fisher merging, kNN voting and
hierarchical aggregation. (The Flower bridge of this lesson is `fedlab_nb.flower`, above the methods.)

The lesson `communication` of `fedlab_nb.repro.course.LESSONS`. One file per method (named after the method or its
paper id); each registers itself on import, and `fedlab_nb.methods` imports every module of every chapter."""
