"""FedAvg and non-IID data: FedAvg itself (the partitioners it is taught with live in `fedlab_nb.data`).

The lesson `basics` of `fedlab_nb.repro.course.LESSONS`. One file per method (named after the method or its
paper id); each registers itself on import, and `fedlab_nb.methods` imports every module of every chapter."""
