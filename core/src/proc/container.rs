//! Containers and PID namespaces: which container a process runs in, seen
//! from its cgroup and `NSpid`, and whether this process sits in a child PID
//! namespace (where `/proc/locks` leaves out every lock taken outside it).

use std::fs;

use super::read_small;

/// Whether this process lives in a child PID namespace, where `/proc/locks`
/// leaves out every lock whose owner is outside it. Its `NSpid` line has
/// more than one pid, unless `/proc` was mounted inside the namespace
/// (`unshare --mount-proc`, a container); then the namespace is not the
/// initial one, whose inode number the kernel fixes (`PROC_PID_INIT_INO`).
pub(crate) fn in_child_pid_namespace() -> bool {
    const INIT_PID_NS_INO: u64 = 0xEFFF_FFFC;
    static CHILD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CHILD.get_or_init(|| {
        let nspid = read_small("/proc/self/status").is_some_and(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("NSpid:"))
                .is_some_and(|pids| pids.split_whitespace().count() > 1)
        });
        let ns = fs::metadata("/proc/self/ns/pid")
            .is_ok_and(|m| std::os::unix::fs::MetadataExt::ino(&m) != INIT_PID_NS_INO);
        nspid || ns
    })
}

/// The pid in this PID namespace of the process the host calls
/// `host_pid` (NVML and amd-smi report the host's pids, also inside a
/// container). Outside a child namespace the two are one. Inside, `None`:
/// since Linux 4.14 the kernel shows a PID namespace nothing but its own
/// numbers (`NSpid`, and `/proc/PID/sched`, which once gave the host's
/// pid), so a host pid cannot be told from a local pid that happens to
/// have the same number, and is never taken for one.
pub(crate) fn local_pid(host_pid: u32) -> Option<u32> {
    (!in_child_pid_namespace()).then_some(host_pid)
}

/// The container a process runs in, as seen from here: `docker 1a2b3c4d5e6f`,
/// `podman ...`, `kubernetes ...`, `lxc NAME` from its cgroup, else `PID
/// namespace, pid N there`; `None` when it shares this PID namespace (its
/// `NSpid` line is no longer than ours) or cannot be read.
pub(crate) fn container_of(pid: u32) -> Option<String> {
    fn nspids(text: &str) -> Option<Vec<&str>> {
        text.lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .map(|pids| pids.split_whitespace().collect())
    }
    let mine = nspids(&read_small("/proc/self/status")?)?.len();
    let status = read_small(format!("/proc/{pid}/status"))?;
    let theirs = nspids(&status)?;
    if theirs.len() <= mine {
        return None;
    }
    let inner = theirs.last().copied().unwrap_or("?");
    let named = read_small(format!("/proc/{pid}/cgroup")).and_then(|c| container_in_cgroup(&c));
    Some(match named {
        Some(name) => format!("{name}, pid {inner} there"),
        None => format!("PID namespace, pid {inner} there"),
    })
}

/// A container engine's name for the cgroup a process is in: Docker's
/// `docker-ID.scope` or `/docker/ID`, Podman's `libpod-ID.scope`,
/// containerd's and CRI-O's `cri-containerd-ID.scope`, `crio-ID.scope` or
/// `/kubepods/.../ID`, LXC's `lxc.payload.NAME` or `/lxc/NAME`. IDs are cut
/// to 12 characters, as `docker ps` shows them.
pub(crate) fn container_in_cgroup(cgroup: &str) -> Option<String> {
    let short = |id: &str| {
        let id: String = id
            .chars()
            .take_while(|c| c.is_ascii_hexdigit())
            .take(12)
            .collect();
        (id.len() == 12).then_some(id)
    };
    for line in cgroup.lines() {
        let path = line.splitn(3, ':').nth(2).unwrap_or("");
        for part in path.split('/').rev() {
            let part = part.strip_suffix(".scope").unwrap_or(part);
            for (prefix, engine) in [
                ("docker-", "docker"),
                ("libpod-", "podman"),
                ("cri-containerd-", "kubernetes"),
                ("crio-", "kubernetes"),
            ] {
                if let Some(id) = part.strip_prefix(prefix).and_then(short) {
                    return Some(format!("{engine} {id}"));
                }
            }
            if let Some(name) = part.strip_prefix("lxc.payload.") {
                return Some(format!("lxc {}", crate::show::sanitize(name)));
            }
        }
        let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
        match parts[..] {
            ["docker", id, ..] => return short(id).map(|id| format!("docker {id}")),
            ["lxc", name, ..] => return Some(format!("lxc {}", crate::show::sanitize(name))),
            ["kubepods", .., id] => {
                if let Some(id) = short(id) {
                    return Some(format!("kubernetes {id}"));
                }
            }
            _ => {}
        }
    }
    None
}
