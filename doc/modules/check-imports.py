"""The rules of devlock's module graph, checked on the source as text (doc
comments left out): every `crate::` and `super::` path of each file of
src/, in `use` declarations and inline (cargo-modules sees only the `use`
declarations), resolved to the module (file) it names. Fails (exit 1) on an
import from flock/ into wait_display, status or cmd, from etcd/ into cmd/,
or on two files that import each other.

    python3 doc/modules/check-imports.py src
"""
import re,os,sys
root=sys.argv[1]
mods={}
for dp,_,fs in os.walk(root):
    for f in fs:
        if not f.endswith('.rs'): continue
        p=os.path.join(dp,f); rel=os.path.relpath(p,root)[:-3]
        parts=rel.split('/')
        if parts[-1] in ('mod','lib','main'): parts=parts[:-1]
        if rel=='main': continue
        mods['::'.join(parts)]=p
def expand_use(text):
    # expand use crate::a::{b, c::{d,e}} into paths
    out=[]
    def rec(prefix, body):
        depth=0; cur=''; items=[]
        for ch in body:
            if ch=='{': depth+=1
            if ch=='}': depth-=1
            if ch==',' and depth==0: items.append(cur); cur=''
            else: cur+=ch
        items.append(cur)
        for it in items:
            it=it.strip()
            if not it: continue
            m=re.match(r'^([\w:]*?)(::)?\{(.*)\}$', it, re.S)
            if m and '{' in it:
                rec(prefix+'::'+m.group(1) if m.group(1) else prefix, m.group(3))
            else:
                name=it.split(' as ')[0].strip()
                out.append(prefix if name=='self' else prefix+'::'+name)
    m=re.match(r'^crate::(.*)$', text, re.S)
    body=m.group(1)
    rec('', '{'+body+'}' if not body.startswith('{') else body) if False else None
    # simpler: treat 'crate::' + rest
    mm=re.match(r'^([\w:]*?)::\{(.*)\}$', body, re.S)
    if mm: rec(mm.group(1), mm.group(2))
    elif body.startswith('{'): rec('', body[1:-1])
    else: out.append(body.split(' as ')[0])
    return out
edges={}
for mod,p in mods.items():
    s=open(p).read()
    s=re.sub(r'//[^\n]*','',s)
    paths=[]
    for m in re.finditer(r'\buse\s+(crate::[^;]*);', s, re.S):
        paths+=expand_use(re.sub(r'\s+','',m.group(1)))
    s2=re.sub(r'\buse\s+crate::[^;]*;','',s,flags=re.S)
    paths+=[m.group(1) for m in re.finditer(r'\bcrate::([\w:]+)', s2)]
    # super:: paths
    parent='::'.join(mod.split('::')[:-1]) if not p.endswith('mod.rs') else '::'.join(mod.split('::')[:-1])
    for m in re.finditer(r'\bsuper::([\w:]+|\{[^}]*\})', s):
        t=m.group(1)
        if t.startswith('{'):
            for x in t[1:-1].split(','): paths.append((parent+'::' if parent else '')+x.strip())
        else: paths.append((parent+'::' if parent else '')+t)
    for path in paths:
        path=path.strip(':')
        parts=path.split('::')
        target=None
        for k in range(len(parts),-1,-1):
            c='::'.join(parts[:k])
            if c in mods: target=c; break
        if target is None or target==mod: continue
        # parent module (mod.rs) declaring child isn't an import
        edges.setdefault(mod,set()).add(target)
def under(n,p): return n==p or n.startswith(p+'::')
bad=[(a,b) for a in edges for b in edges[a] if under(a,'flock') and any(under(b,x) for x in ['wait_display','status','cmd'])]
print('flock -> wait_display/status/cmd:',sorted(bad))
print('etcd -> cmd:',sorted((a,b) for a in edges for b in edges[a] if under(a,'etcd') and under(b,'cmd')))
mut=sorted({tuple(sorted((a,b))) for a in edges for b in edges[a] if a in edges.get(b,()) })
print('mutual file pairs:',mut)
etcd_cmd=[(a,b) for a in edges for b in edges[a] if under(a,'etcd') and under(b,'cmd')]
if bad or etcd_cmd or mut:
    sys.exit(1)
