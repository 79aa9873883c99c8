#!/usr/bin/env bash
# Makes doc/modules/modules.svg, the picture of devlock's module graph (the
# library with the etcd backend, its modules and the `use` edges between
# them; each edge points from the module that imports to the one imported),
# and checks the graph's rules on the source. Needs cargo-modules
# (`cargo install cargo-modules`, 0.27 for rustc 1.95) and graphviz
# (`apt-get install --no-install-recommends graphviz`).
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo modules dependencies -p devlock --lib --features etcd \
  --no-externs --no-sysroot --no-fns --no-traits --no-types --no-owns \
  --layout dot --splines spline >doc/modules/cargo-modules.dot
# Drawn top down (what imports above what it imports), with plain boxes and
# unlabelled edges: cargo-modules' record shapes and unconstrained edges
# make dot lose edges.
sed -e 's/\[constraint=false\]//' -e 's/shape="record"/shape="box"/' \
  -e 's/rankdir=LR/rankdir=TB/' -e 's/|/\\n/' -e 's/label="uses", //' \
  doc/modules/cargo-modules.dot >doc/modules/modules.dot
rm doc/modules/cargo-modules.dot
dot -Tsvg doc/modules/modules.dot >doc/modules/modules.svg
python3 doc/modules/check-imports.py src
