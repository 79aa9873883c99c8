//! The documented lists against what is served: every metric family, and the
//! Prometheus examples.

use super::*;

/// The `devlock_...` names in `text`.
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    for (at, _) in text.match_indices("devlock_") {
        let name: String = text[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        // DEVLOCK_DIR and friends are variables, not metrics.
        if at == 0 || !text[..at].ends_with(|c: char| c.is_ascii_alphanumeric()) {
            names.insert(name);
        }
    }
    names.retain(|n| n.len() > "devlock_".len() && n.to_ascii_lowercase() == *n);
    names
}

test!(every_metric_family_is_documented_and_every_documented_one_served, needs: []);
pub(crate) fn every_metric_family_is_documented_and_every_documented_one_served() {
    let s = Scratch::new();
    let server = Server::start(&mut s.devlock(), &[]);
    let text = server.get("/metrics").body;
    let served: std::collections::BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| l.split(' ').next().unwrap().to_owned())
        .collect();
    assert!(served.len() > 20, "{text}");
    let page = std::fs::read_to_string(format!("{REPO}/man/devlock-serve.1")).unwrap();
    let metrics_section = xtask::sections(&page)
        .into_iter()
        .find(|(title, _)| title == "METRICS")
        .expect("devlock-serve(1) has a METRICS section")
        .1
        .replace("\\_", "_")
        .replace("\\-", "-");
    assert_eq!(
        metric_names(&metrics_section),
        served,
        "man/devlock-serve.1's METRICS"
    );
    // What the contrib files ask for is served.
    for file in [
        "contrib/grafana/devlock.json",
        "contrib/prometheus/devlock-rules.yml",
    ] {
        let text = std::fs::read_to_string(format!("{REPO}/{file}")).unwrap();
        let asked = metric_names(&text);
        assert!(!asked.is_empty(), "{file}");
        let unknown: Vec<_> = asked.difference(&served).collect();
        assert!(unknown.is_empty(), "{file} asks for {unknown:?}");
    }
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{REPO}/contrib/grafana/devlock.json")).unwrap(),
    )
    .unwrap();
    assert!(!dashboard["panels"].as_array().unwrap().is_empty());
}

test!(the_prometheus_examples_pass_promtool, needs: [Tool("promtool")]);
pub(crate) fn the_prometheus_examples_pass_promtool() {
    let config = format!("{REPO}/contrib/prometheus/prometheus.yml");
    let out = Command::new("promtool")
        .args(["check", "config", &config])
        .current_dir(format!("{REPO}/contrib/prometheus"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let rules = format!("{REPO}/contrib/prometheus/devlock-rules.yml");
    let out = Command::new("promtool")
        .args(["check", "rules", &rules])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
}
