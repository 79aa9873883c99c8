//! Without amd-smi: the DRM clients' fdinfo (VRAM per process) and the
//! sysfs amdgpu cards.

use super::*;

/// One open DRM file, from its fdinfo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DrmClient {
    /// `amdgpu`, `i915`, `xe`, ...
    pub(crate) driver: String,
    /// PCI address of the device.
    pub(crate) pdev: Option<String>,
    /// The same for every descriptor of one open file.
    pub(crate) client_id: Option<u64>,
    /// VRAM resident for this client; `None` when the driver does not say.
    pub(crate) vram_kib: Option<u64>,
}

/// `N`, `N KiB`, `N MiB` (and `GiB`) in KiB; anything else unknown.
pub(super) fn kib(value: &str) -> Option<u64> {
    let mut words = value.split_whitespace();
    let number: u64 = words.next()?.parse().ok()?;
    let kib = match words.next() {
        None => number / 1024,
        Some("KiB") => number,
        Some("MiB") => number.checked_mul(1024)?,
        Some("GiB") => number.checked_mul(1024 * 1024)?,
        Some(_) => return None,
    };
    words.next().is_none().then_some(kib)
}

/// Parses one `/proc/PID/fdinfo/FD`; `None` when it is no DRM file.
pub(crate) fn parse_fdinfo(text: &str) -> Option<DrmClient> {
    let mut fields = BTreeMap::new();
    for line in text.lines() {
        if let Some((key, value)) = line.split_once(':') {
            fields.entry(key.trim()).or_insert_with(|| value.trim());
        }
    }
    let driver = fields.get("drm-driver")?;
    let vram = fields
        .get("drm-resident-vram")
        .or_else(|| fields.get("drm-memory-vram"))
        .and_then(|v| kib(v));
    Some(DrmClient {
        driver: (*driver).to_owned(),
        pdev: fields.get("drm-pdev").map(|s| (*s).to_owned()),
        client_id: fields.get("drm-client-id").and_then(|s| s.parse().ok()),
        vram_kib: vram,
    })
}

/// What one scan of `/proc` found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Scan {
    /// Each DRM file a process holds open, one entry per descriptor.
    pub(crate) clients: Vec<(u32, DrmClient)>,
    /// Processes whose descriptors could not be read (another user's,
    /// without root): what they hold on a GPU is unknown.
    pub(crate) unreadable: Vec<u32>,
}

/// Reads the DRM files of every process under `proc_root` (`/proc`).
pub(crate) fn scan_fdinfo(proc_root: &Path) -> std::io::Result<Scan> {
    let mut scan = Scan::default();
    for pid in crate::proc::process::pids_in(proc_root)? {
        let process = proc_root.join(pid.to_string());
        let fds = match std::fs::read_dir(process.join("fd")) {
            Ok(fds) => fds,
            // Gone since the listing: nothing to say about it.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(_) => {
                scan.unreadable.push(pid);
                continue;
            }
        };
        for fd in fds.flatten() {
            let Ok(target) = std::fs::read_link(fd.path()) else {
                continue;
            };
            if !target.starts_with("/dev/dri/") {
                continue;
            }
            let info = process.join("fdinfo").join(fd.file_name());
            if let Some(client) = std::fs::read_to_string(info)
                .ok()
                .as_deref()
                .and_then(parse_fdinfo)
            {
                scan.clients.push((pid, client));
            }
        }
    }
    scan.unreadable.sort_unstable();
    Ok(scan)
}

/// Per device (`drm-pdev`), each process's VRAM, counting an open file once
/// per process however many descriptors share it. Only `driver`'s files;
/// a process whose files do not say how much VRAM they hold is `None`.
pub(crate) fn vram_by_device(
    clients: &[(u32, DrmClient)],
    driver: &str,
) -> BTreeMap<String, Vec<(u32, Option<u64>)>> {
    // (pdev, pid) -> (client ids counted, KiB so far, every one known)
    let mut usage: BTreeMap<(String, u32), (BTreeSet<u64>, u64, bool)> = BTreeMap::new();
    for (pid, client) in clients.iter().filter(|(_, c)| c.driver == driver) {
        let Some(pdev) = &client.pdev else { continue };
        let (counted, kib, known) = usage
            .entry((pdev.clone(), *pid))
            .or_insert_with(|| (BTreeSet::new(), 0, true));
        if is_new(counted, client.client_id) {
            match client.vram_kib {
                Some(more) => *kib += more,
                None => *known = false,
            }
        }
    }
    let mut out: BTreeMap<String, Vec<(u32, Option<u64>)>> = BTreeMap::new();
    for ((pdev, pid), (_, kib, known)) in usage {
        out.entry(pdev)
            .or_default()
            .push((pid, known.then_some(kib / 1024)));
    }
    out
}

/// Whether a client id is counted for the first time (no id: always).
pub(super) fn is_new(counted: &mut BTreeSet<u64>, id: Option<u64>) -> bool {
    id.is_none_or(|id| counted.insert(id))
}

/// An amdgpu device as its sysfs files describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SysfsGpu {
    /// The card, e.g. `card1`.
    pub(crate) card: String,
    /// PCI address (the `device` link's target).
    pub(crate) pdev: Option<String>,
    pub(crate) vram_total_mib: Option<u64>,
    pub(crate) vram_used_mib: Option<u64>,
    pub(crate) busy_pct: Option<u32>,
}

/// The amdgpu cards under `drm_class` (`/sys/class/drm`), in card order.
pub(crate) fn read_sysfs(drm_class: &Path) -> std::io::Result<Vec<SysfsGpu>> {
    let number =
        |name: &Path| -> Option<u64> { std::fs::read_to_string(name).ok()?.trim().parse().ok() };
    let mut cards = Vec::new();
    for entry in std::fs::read_dir(drm_class)?.flatten() {
        let card = entry.file_name().to_string_lossy().into_owned();
        // card1, not card1-DP-1 (a connector) or renderD128.
        let Some(n) = card
            .strip_prefix("card")
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let device = entry.path().join("device");
        let uevent = std::fs::read_to_string(device.join("uevent")).unwrap_or_default();
        if !uevent.lines().any(|l| l == "DRIVER=amdgpu") {
            continue;
        }
        let pdev = uevent
            .lines()
            .find_map(|l| l.strip_prefix("PCI_SLOT_NAME="))
            .map(str::to_owned);
        cards.push((
            n,
            SysfsGpu {
                card,
                pdev,
                vram_total_mib: number(&device.join("mem_info_vram_total")).map(|b| b / MIB),
                vram_used_mib: number(&device.join("mem_info_vram_used")).map(|b| b / MIB),
                busy_pct: number(&device.join("gpu_busy_percent"))
                    .and_then(|p| u32::try_from(p).ok())
                    .filter(|p| *p <= 100),
            },
        ));
    }
    cards.sort_by_key(|(n, _)| *n);
    Ok(cards.into_iter().map(|(_, card)| card).collect())
}
