#!/usr/bin/env python3
"""devlock's module graph, from the source: every `crate::`, `super::` and
`self::` path of each file of src/ (and core/src/ once the crate is split),
in `use` declarations and inline, resolved to the file that defines what it
names (a re-export, `pub(crate) use crate::x::Item;` or `use crate::x as y;`,
is followed to the file it re-exports). Test code (`#[cfg(test)]`) is left
out. No cargo plugin, no clap: python3 and graphviz's `dot`.

    python3 doc/modules/graph.py [--dot FILE] [--check] [ROOT]

draws the graph of top-level modules (the core's boxed together) as DOT,
an edge per module pair from the importer to the imported, red where the
core imports a front end or where the edge closes a circle (a module whose
own files import each other in a circle is drawn red too), and lists both
on stderr. `--check` exits 1 if there is either.
"""
import collections, json, os, re, sys

# The kernel-facing core (issue 36): no words for people, no screen, no
# command line. Everything else is a front end; usage/report* is `devlock
# report`'s, a front end's.
CORE = {'sys', 'proc', 'flock', 'gpu', 'resource', 'request', 'names', 'interrupt', 'usage',
        'view', 'walk', 'take', 'plan', 'error', 'show', 'units', 'job_env', 'hold_watch', 'hold_event'}

args = sys.argv[1:]
dot_out = None
check = False
while args and args[0].startswith('--'):
    flag = args.pop(0)
    if flag == '--dot':
        dot_out = args.pop(0)
    elif flag == '--check':
        check = True
    else:
        sys.exit(__doc__)
ROOT = args[0] if args else os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..')
SRCS = [d for d in ('src', 'core/src') if os.path.isdir(os.path.join(ROOT, d))]
files = []
for src in SRCS:
    for d, _, fs in os.walk(os.path.join(ROOT, src)):
        for f in fs:
            if f.endswith('.rs'):
                files.append(os.path.relpath(os.path.join(d, f), ROOT))

def modpath(f):
    p = re.sub(r'^(core/)?src/', '', f)[:-3].split('/')
    if p[-1] == 'mod': p = p[:-1]
    if p == ['lib'] or p == ['main']: return ()
    return tuple(p)
mods = {modpath(f): f for f in files if not f.endswith('main.rs')}
def strip(text):
    # remove comments and string literals (roughly), keep line structure
    out = []; i = 0; n = len(text)
    res = []
    while i < n:
        c = text[i]
        if text.startswith('//', i):
            j = text.find('\n', i); j = n if j < 0 else j
            res.append(' ' * (j - i)); i = j; continue
        if text.startswith('/*', i):
            j = text.find('*/', i + 2); j = n if j < 0 else j + 2
            res.append(re.sub(r'[^\n]', ' ', text[i:j])); i = j; continue
        if c == '"' :
            # raw strings not handled exactly
            j = i + 1
            while j < n and text[j] != '"':
                if text[j] == '\\': j += 1
                j += 1
            res.append('"' + re.sub(r'[^\n]', ' ', text[i+1:j]) + '"'); i = j + 1; continue
        if c == "'" and i + 2 < n and (text[i+2] == "'" or (text[i+1] == '\\')):
            j = text.find("'", i + 2 if text[i+1] != '\\' else i + 3)
            res.append(' ' * (j - i + 1)); i = j + 1; continue
        res.append(c); i += 1
    return ''.join(res)
def test_ranges(text):
    # lines inside #[cfg(test)] items
    lines = text.split('\n'); rng = []
    i = 0
    while i < len(lines):
        if re.match(r'\s*#\[cfg\(test\)\]', lines[i]):
            # find start brace
            depth = 0; started = False; j = i
            while j < len(lines):
                for ch in lines[j]:
                    if ch == '{': depth += 1; started = True
                    elif ch == '}': depth -= 1
                if started and depth == 0: break
                if not started and lines[j].rstrip().endswith(';') and j > i: break
                j += 1
            rng.append((i + 1, j + 1)); i = j + 1; continue
        i += 1
    return rng
def expand(tree):
    # tree: string of a use tree without 'use' and ';'
    tree = re.sub(r'\s+', '', tree)
    def parse(s, prefix):
        out = []
        # split top-level by commas
        depth = 0; cur = ''; parts = []
        for ch in s:
            if ch == '{': depth += 1
            if ch == '}': depth -= 1
            if ch == ',' and depth == 0: parts.append(cur); cur = ''
            else: cur += ch
        if cur: parts.append(cur)
        for p in parts:
            m = p.find('{')
            if m >= 0:
                head = p[:m].rstrip(':')
                inner = p[m+1:p.rfind('}')]
                out += parse(inner, prefix + ([x for x in head.split('::') if x]))
            else:
                p = re.sub(r'\bas\b.*', '', p)
                out.append(prefix + [x for x in p.split('::') if x])
        return out
    return parse(tree, [])
def resolve(segs, cur, is_modfile):
    # returns absolute seg list starting from crate root or None
    if not segs: return None
    base = list(cur)
    if segs[0] == 'crate': return segs[1:]
    if segs[0] in ('self',): return base + segs[1:]
    if segs[0] == 'super':
        b = base[:]
        while segs and segs[0] == 'super':
            b = b[:-1]; segs = segs[1:]
        return b + segs
    return None
def target(abs_segs):
    best = None
    for k in range(len(abs_segs), 0, -1):
        if tuple(abs_segs[:k]) in mods:
            best = (tuple(abs_segs[:k]), abs_segs[k:]); break
    return best

# Re-exports: file -> {name: the file that defines it}.
def modfile(segs):
    for k in range(len(segs), 0, -1):
        if tuple(segs[:k]) in mods:
            return mods[tuple(segs[:k])]
    return None
reexports = collections.defaultdict(dict)
for f in files:
    text = strip(open(os.path.join(ROOT, f)).read())
    for m in re.finditer(r'pub(?:\([\w ]+\))?\s+use\s+(?:crate|devlock_core)::([\w:]+?)'
                         r'(?:::\{([^}]*)\}|\s+as\s+(\w+))?\s*;', text):
        path = m.group(1).split('::')
        if m.group(3):
            target_file = modfile(path)
            if target_file:
                reexports[f][m.group(3)] = target_file
        elif m.group(2):
            target_file = modfile(path)
            for name in re.split(r'\s*,\s*', m.group(2).strip()):
                name = name.split(' as ')[-1].strip()
                if name == 'self':
                    name = path[-1]
                if target_file and name:
                    reexports[f][name] = target_file
        else:
            target_file = modfile(path[:-1]) if len(path) > 1 else None
            if target_file:
                reexports[f][path[-1]] = target_file

def follow(dst, item):
    seen = set()
    while True:
        first = item.split('::')[0]
        if first not in reexports.get(dst, {}):
            first = re.sub(r'as\w+$', '', first)
        if first in reexports.get(dst, {}) and (dst, first) not in seen:
            seen.add((dst, first))
            dst = reexports[dst][first]
            item = '::'.join(item.split('::')[1:]) or first
        else:
            return dst

edges = collections.defaultdict(lambda: collections.defaultdict(set))
for f in files:
    text = open(os.path.join(ROOT, f)).read()
    s = strip(text)
    tests = test_ranges(text)
    cur = modpath(f)
    def in_test(line):
        return any(a <= line <= b for a, b in tests)
    found = []
    for m in re.finditer(r'\buse\s+((?:crate|super|self)(?:[^;]*));', s):
        line = s.count('\n', 0, m.start()) + 1
        for segs in expand(m.group(1)):
            found.append((line, segs, 2))
    s2 = re.sub(r'\buse\s+[^;]*;', lambda m: re.sub(r'[^\n]', ' ', m.group(0)), s)
    for m in re.finditer(r'(?<![\w:])((?:crate|super)(?:::\w+)+)', s2):
        found.append((s2.count('\n', 0, m.start()) + 1, m.group(1).split('::'), 1))
    for line, segs, keep in found:
        if in_test(line):
            continue
        a = resolve(segs, cur, f.endswith('mod.rs'))
        t = a and target(a)
        if not t:
            continue
        item = '::'.join(t[1][:keep]) or '*mod*'
        dst = follow(mods[t[0]], item)
        if dst != f:
            edges[f][dst].add(line)

def top(f):
    p = re.sub(r'^(core/)?src/', '', f)[:-3].split('/')
    if p[0] == 'usage' and len(p) > 1 and p[1].startswith('report'):
        return 'report'
    return 'crate' if p[0] in ('lib', 'main') else p[0]

def is_core(module):
    return module in CORE

def sccs(adj):
    sys.setrecursionlimit(10000)
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]
    def visit(v):
        index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
        for w in sorted(adj.get(v, ())):
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))
    for v in sorted(set(adj) | {w for ws in adj.values() for w in ws}):
        if v not in index:
            visit(v)
    return [c for c in out if len(c) > 1]

file_adj = {f: set(d) for f, d in edges.items()}
module_adj = collections.defaultdict(set)
for f, dd in edges.items():
    for d in dd:
        if top(f) != top(d):
            module_adj[top(f)].add(top(d))
file_circles = sccs(file_adj)
module_circles = sccs(module_adj)
in_circle = {m: i for i, c in enumerate(module_circles) for m in c}
circled_modules = {top(f) for c in file_circles for f in c}
upward = sorted((f, line, d) for f, dd in edges.items() for d, lines in dd.items()
                for line in lines if is_core(top(f)) and not is_core(top(d)))

for f, line, d in upward:
    print(f'core -> front end: {f}:{line} -> {d}', file=sys.stderr)
for c in file_circles:
    print(f'circle of {len(c)} files: ' + ', '.join(c), file=sys.stderr)

def node(m):
    red = ', color="red", fontcolor="red"' if m in circled_modules else ''
    return f'  "{m}" [shape="box"{red}];'
modules = sorted(set(module_adj) | {w for ws in module_adj.values() for w in ws})
lines = ['digraph modules {', '  rankdir=TB;', '  node [fontname="sans-serif"];',
         '  subgraph cluster_core {', '    label="core";', '    style="rounded";']
lines += ['  ' + node(m) for m in modules if is_core(m)]
lines += ['  }']
lines += [node(m) for m in modules if not is_core(m)]
for m in sorted(module_adj):
    for d in sorted(module_adj[m]):
        bad = (is_core(m) and not is_core(d)) or (m in in_circle and in_circle.get(d) == in_circle[m])
        lines.append(f'  "{m}" -> "{d}"' + (' [color="red"];' if bad else ';'))
lines.append('}')
text = '\n'.join(lines) + '\n'
if dot_out:
    open(dot_out, 'w').write(text)
else:
    sys.stdout.write(text)
if check and (upward or file_circles):
    sys.exit(1)
