//! The GPUs table of `devlock status`: each GPU's memory and use, and its
//! processes, gated or not.

use super::*;

pub(super) fn devices_table(devices: &[Device], render: Render) -> String {
    let header = [
        "GPU", "NAME", "MEMORY", "UTIL", "PID", "PROCESS", "USER", "USED", "GATE",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    let mut warnings = String::new();
    for d in devices {
        // In MIG mode the GPU's own list is every instance's processes;
        // each is shown once, under its instance.
        let in_instances = |pid: u32| {
            d.mig_instances
                .iter()
                .any(|i| i.processes.iter().any(|p| p.pid == pid))
        };
        let own: Vec<&DeviceProcess> = d
            .processes
            .iter()
            .filter(|p| !in_instances(p.pid))
            .collect();
        let row = vec![
            d.index.to_string(),
            sanitize(&d.name),
            memory(d.memory_used_mib, d.memory_total_mib),
            d.utilization_pct
                .map_or("?".to_owned(), |u| format!("{u}%")),
        ];
        let place = format!("GPU {}", d.index);
        process_rows(
            &mut rows,
            &mut warnings,
            row,
            &own,
            &d.processes_unknown,
            &place,
        );
        if let Some(why) = &d.mig_unknown {
            warnings.push_str(&format!(
                "warning: GPU {} is in MIG mode and its instances are unknown: {}\n",
                d.index,
                sanitize(why)
            ));
        }
        for i in &d.mig_instances {
            let name = i.name.clone().unwrap_or_else(|| {
                format!(
                    "gpu:{}:?:gi{}.ci{}",
                    d.index, i.gpu_instance_id, i.compute_instance_id
                )
            });
            let row = vec![
                name.clone(),
                format!(
                    "MIG {}",
                    i.profile.as_deref().map_or("?".to_owned(), sanitize)
                ),
                memory(i.memory_used_mib, i.memory_total_mib),
                "-".to_owned(),
            ];
            let refs: Vec<&DeviceProcess> = i.processes.iter().collect();
            process_rows(
                &mut rows,
                &mut warnings,
                row,
                &refs,
                &i.processes_unknown,
                &name,
            );
        }
    }
    let rows: Vec<Row> = rows.into_iter().map(Row::Cells).collect();
    // NAME and PROCESS give way first.
    format!(
        "\n{}{warnings}",
        align(&rows, render, &[1, 5], paint_device_cell)
    )
}

pub(super) fn memory(used: Option<u64>, total: Option<u64>) -> String {
    format!(
        "{} / {}",
        used.map_or("?".to_owned(), format_mib),
        total.map_or("?".to_owned(), format_mib)
    )
}

/// `outside devlock: pid 4242 python3, bob, 11.7 GiB`, or for several
/// processes their count and memory (the GPUs table lists each).
pub(super) fn outside_words(uses: &[OutsideUse]) -> String {
    let used = |u: &OutsideUse| u.used_mib.map_or("? MiB".to_owned(), format_mib);
    match uses {
        [one] => format!(
            "outside devlock: {}{}, {}, {}",
            if one.pid == 0 {
                String::new()
            } else {
                format!("pid {} ", one.pid)
            },
            sanitize(&one.name),
            one.user
                .as_deref()
                .map_or("user unknown".to_owned(), sanitize),
            used(one)
        ),
        many => {
            let known: u64 = many.iter().filter_map(|u| u.used_mib).sum();
            let unknown = if many.iter().any(|u| u.used_mib.is_none()) {
                " and more"
            } else {
                ""
            };
            format!(
                "outside devlock: {} processes, {}{unknown}",
                many.len(),
                format_mib(known)
            )
        }
    }
}

/// A device's row and one more per process; a warning for each process
/// outside the gate, and for a list that is unknown.
pub(super) fn process_rows(
    rows: &mut Vec<Vec<String>>,
    warnings: &mut String,
    mut row: Vec<String>,
    processes: &[&DeviceProcess],
    unknown: &Option<String>,
    place: &str,
) {
    if let Some(why) = unknown {
        row.push("?".to_owned());
        rows.push(row);
        warnings.push_str(&format!(
            "warning: the processes on {place} are unknown: {}\n",
            sanitize(why)
        ));
        return;
    }
    if processes.is_empty() {
        row.push("-".to_owned());
        rows.push(row);
        return;
    }
    let width = row.len();
    for (i, p) in processes.iter().enumerate() {
        if i > 0 {
            row = vec![String::new(); width];
        }
        let used = p.used_mib.map_or("?".to_owned(), format_mib);
        let user = p.user().map_or("?".to_owned(), sanitize);
        let pid = if p.pid == 0 {
            "?".to_owned()
        } else {
            p.pid.to_string()
        };
        let name = match &p.container {
            Some(container) => format!("{} (in {})", sanitize(&p.name), sanitize(container)),
            None => sanitize(&p.name),
        };
        row.extend([
            pid.clone(),
            name,
            user.clone(),
            used.clone(),
            p.gate()
                .map_or_else(|| "NOT GATED".to_owned(), str::to_owned),
        ]);
        rows.push(row.clone());
        if !p.gated() {
            warnings.push_str(&format!(
                "warning: pid {pid} ({}, {user}) uses {used} on {place} without holding its lock\n",
                sanitize(&p.name),
            ));
        }
    }
}
