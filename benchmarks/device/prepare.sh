#!/usr/bin/env bash
# Run HERE (the CPU machine, which reaches the package registries) before a device call: the Python 3.12 wheels
# the GPU machine's image lacks (fedlab_nb imports them; torch, numpy, pandas, scipy, scikit-learn/-image are
# there) into .whl/, and Fashion-MNIST (the 1,000-client workloads) into .device-data/. Both are git-ignored and
# travel with `carry`; about 40 MB of the 64 MiB a call may carry. See benchmarks/README.md, "On a GPU".
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .whl && mkdir -p .whl .device-data/fashion_mnist
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    mlxtend==0.25.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 pycryptodome==3.24.1 \
    pfl==0.6.0 dp-accounting==0.5.1 prv-accountant==0.2.0 multiprocess==0.70.19 dill==0.4.1 dm-tree==0.1.10
# (the last line: pfl-research and what it needs beyond the image, for benchmarks/device/pfl.sh; on the GPU machine
# pfl and fedlab_nb share one environment: dp-accounting 0.5.1 satisfies both, and flwr, the conflict here, is absent)
fashion=${FASHION_DIR:-/usr/share/datasets/fashion-mnist}
cp "$fashion"/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz .device-data/fashion_mnist/
du -sh .whl .device-data
