#!/usr/bin/env bash
# Makes doc/modules/modules.svg, the picture of devlock's module graph (a box
# per top-level module, the core's boxed together; each edge points from the
# module that imports to the one imported; red: the core importing a front
# end, or an edge of a circle), and checks the graph's rules on the source:
# no circle of any length, no import from the core into a front end.
# Needs python3 and graphviz (`apt-get install --no-install-recommends
# graphviz`); no cargo plugin.
set -euo pipefail
cd "$(dirname "$0")/../.."
status=0
python3 doc/modules/graph.py --check --dot doc/modules/modules.dot . || status=$?
dot -Tsvg doc/modules/modules.dot >doc/modules/modules.svg
exit "$status"
