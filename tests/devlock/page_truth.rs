//! The page tells the truth at a glance (#34.2): a GPU that a process
//! outside devlock uses is "in use outside devlock" on the page and "in
//! use" in status, never free, for root, for another user, and for a
//! server that cannot see the process's owner; every colour on the page
//! is in its legend; the last day by user is `devlock report`'s. Through
//! the real binary, the fake NVML, setpriv and a real headless browser.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

use crate::harness::*;
use crate::nvml::{fake_nvml, with_nvml};
use crate::serve::{Server, dump_dom, which};
use crate::usage::{end_line, now_ms, start_line};

const H: u64 = 3_600_000;

/// Three GPUs: gpu:0 held by root's job (its worker `@PID1@`), gpu:1
/// used by a process outside devlock (`@PID2@`, 11980 MiB), gpu:2 free
/// and empty.
const SCENARIO: &str = "driver 550.127.05\n\
    gpu 0 GPU-0a000000-0000-4000-8000-000000000000 81559 20000 90 NVIDIA H100 80GB HBM3\n\
    gpu 1 GPU-1b000000-0000-4000-8000-000000000001 81559 12000 40 NVIDIA H100 80GB HBM3\n\
    gpu 2 GPU-2c000000-0000-4000-8000-000000000002 81559 0 0 NVIDIA H100 80GB HBM3\n\
    mig 0 0 0\nmig 1 0 0\nmig 2 0 0\n\
    process 0 @PID1@ 19000\n\
    process 1 @PID2@ 11980\n";

/// What the stranger's program is called: every character the page must
/// escape, and a right-to-left override (within comm's 15 bytes).
const HOSTILE_NAME: &str = "<s>&'\"\u{202e}z";

/// The scene: root set up, root's `train` holding gpu:0 with a worker,
/// and a process of USER_A on gpu:1 outside every gate.
struct Scene {
    s: Scratch,
    library: std::path::PathBuf,
    pids: Vec<u32>,
    _holder: Killed,
    _stranger: Killed,
}

impl Scene {
    fn new() -> Scene {
        let s = Scratch::new();
        let library = fake_nvml(&s, SCENARIO);
        let setup = with_nvml(&s, &library, &[])
            .args(["setup", "--idle-timeout", "2h", "--gpus"])
            .output()
            .unwrap();
        assert!(setup.status.success(), "{}", stderr(&setup));
        let (worker_file, ready) = (s.work("train.pid"), s.work("train.ready"));
        let holder = Killed(
            with_nvml(&s, &library, &[])
                .args(["--step", "train", "gpu:0", "--", "sh", "-c"])
                .arg(format!(
                    "sleep 1000 & echo $! > {w}.tmp; mv {w}.tmp {w}; echo > {r}; wait",
                    w = worker_file.display(),
                    r = ready.display()
                ))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .process_group(0)
                .spawn()
                .unwrap(),
        );
        wait_for_file(&ready);
        let worker = pid_in(&worker_file);
        // The stranger: a copy of sleep(1) under a hostile name, as USER_A.
        let program = s.work(HOSTILE_NAME);
        std::fs::copy(which("sleep"), &program).unwrap();
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
        let stranger = Killed(
            as_user(USER_A, program.to_str().unwrap())
                .arg("1000")
                .spawn()
                .unwrap(),
        );
        Scene {
            s,
            library,
            pids: vec![worker, stranger.id()],
            _holder: holder,
            _stranger: stranger,
        }
    }

    /// devlock with this scene's GPUs, as root.
    fn devlock(&self) -> Command {
        with_nvml(&self.s, &self.library, &self.pids)
    }

    /// devlock with this scene's GPUs, as `uid`, under `/proc` mounted
    /// with `hidepid=2` when `hidden` (a mount namespace of its own: the
    /// other users' processes are hidden from it, as on a locked-down
    /// machine).
    fn devlock_as(&self, uid: u32, hidden: bool) -> Command {
        let mut cmd = Command::new("unshare");
        let mount = if hidden {
            "mount -t proc -o hidepid=2 proc /proc && "
        } else {
            ""
        };
        cmd.args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg(format!("{mount}exec \"$0\" \"$@\""))
            .args([
                "setpriv",
                &format!("--reuid={uid}"),
                &format!("--regid={uid}"),
                "--clear-groups",
                "--",
                BIN,
            ]);
        let root = self.devlock();
        for (key, value) in root.get_envs() {
            match value {
                Some(value) => cmd.env(key, value),
                None => cmd.env_remove(key),
            };
        }
        cmd
    }
}

impl Drop for Scene {
    /// Ends the holder's whole group: its command and its worker, which
    /// would otherwise outlive the test holding its output.
    fn drop(&mut self) {
        // SAFETY: kill(2) of the process group this scene started.
        unsafe { libc::kill(-(self._holder.id() as i32), libc::SIGKILL) };
    }
}

/// The card of gpu:`index` in a page or DOM.
fn card(page: &str, index: u32) -> String {
    page.split(&format!("id=\"gpu-{index}\""))
        .nth(1)
        .and_then(|rest| rest.split("</article>").next())
        .unwrap_or_else(|| panic!("no card for gpu:{index} in {page}"))
        .to_owned()
}

/// The opening tag's class of gpu:`index`'s card.
fn card_class(page: &str, index: u32) -> String {
    let before = page.split(&format!("id=\"gpu-{index}\"")).next().unwrap();
    let tag = before.rsplit("<article").next().unwrap();
    tag.split("class=\"")
        .nth(1)
        .unwrap()
        .split('"')
        .next()
        .unwrap()
        .to_owned()
}

/// The status table's row of `resource`.
fn row<'a>(table: &'a str, resource: &str) -> &'a str {
    table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(resource))
        .unwrap_or_else(|| panic!("no row for {resource} in\n{table}"))
}

test!(an_ungated_process_makes_the_page_and_status_say_in_use_never_free, needs: [Root, Tool("setpriv"), Tool("unshare"), Tool("cc"), Tool("chromium-headless-shell")]);
pub(crate) fn an_ungated_process_makes_the_page_and_status_say_in_use_never_free() {
    let scene = Scene::new();
    let stranger = scene.pids[1];
    status_says_in_use_as_root_and_another_user(&scene, stranger);
    status_json_says_in_use_outside(&scene, stranger);
    the_page_in_a_browser_says_in_use(&scene, stranger);
    one_who_cannot_see_the_process_is_told_in_use(&scene, stranger);
}

/// status, as root and as another user: gpu:1 is in use, with the process,
/// its user and its memory; gpu:2, truly free, is not.
fn status_says_in_use_as_root_and_another_user(scene: &Scene, stranger: u32) {
    for uid in [0, USER_B] {
        let out = scene.devlock_as(uid, false).arg("status").output().unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        let table = stdout(&out);
        let gpu1 = row(&table, "gpu:1");
        assert!(
            gpu1.contains("in use")
                && gpu1.contains(&format!("outside devlock: pid {stranger} "))
                && gpu1.contains("nobody")
                && gpu1.contains("11.7 GiB")
                && !gpu1.contains("free"),
            "as {uid}:\n{table}"
        );
        assert!(!table.contains('\u{202e}'), "{table}");
        let all = stdout(
            &scene
                .devlock_as(uid, false)
                .args(["status", "--all"])
                .output()
                .unwrap(),
        );
        assert!(row(&all, "gpu:2").contains("free"), "{all}");
    }
}

/// status --json: the lock free, the GPU in use outside, the process named
/// and its name cleaned.
fn status_json_says_in_use_outside(scene: &Scene, stranger: u32) {
    let json = json_of(&scene.devlock().args(["status", "--json"]).output().unwrap());
    let view = |name: &str| {
        json["resources"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == name)
            .unwrap()
            .clone()
    };
    let gpu1 = view("gpu:1");
    assert_eq!(gpu1["state"], "free", "the lock itself: {gpu1}");
    assert_eq!(gpu1["in_use_outside"][0]["pid"], stranger, "{gpu1}");
    assert_eq!(gpu1["in_use_outside"][0]["user"], "nobody", "{gpu1}");
    assert_eq!(gpu1["in_use_outside"][0]["used_mib"], 11980, "{gpu1}");
    assert_eq!(
        gpu1["in_use_outside"][0]["name"], "<s>&'\"?z",
        "cleaned: {gpu1}"
    );
    assert!(view("gpu:2").get("in_use_outside").is_none());
    assert!(
        view("gpu:0").get("in_use_outside").is_none(),
        "its worker is inside the gate"
    );
}

/// The page, served by root, in a real browser.
fn the_page_in_a_browser_says_in_use(scene: &Scene, stranger: u32) {
    let server = Server::start(&mut scene.devlock(), &[]);
    let page = server.get("/").body;
    let chromium = which("chromium-headless-shell");
    let dom = dump_dom(&chromium, &scene.s.work("chromium"), &server.url("/"));
    for shown in [&page, &dom] {
        let gpu1 = card(shown, 1);
        assert_eq!(card_class(shown, 1), "gpu outside", "{gpu1}");
        assert!(
            gpu1.contains("<span class=\"state\">in use outside devlock</span>")
                && !gpu1.contains(">free<")
                && gpu1.contains("nobody")
                && gpu1.contains("11.7 GiB")
                && gpu1.contains(&format!("pid {stranger}")),
            "{gpu1}"
        );
        assert_eq!(card_class(shown, 2), "gpu free");
        assert!(card(shown, 2).contains("<span class=\"state\">free</span>"));
        assert_eq!(card_class(shown, 0), "gpu held");
    }
    // What a user wrote is text: escaped, the override replaced.
    assert!(
        card(&page, 1).contains("&lt;s&gt;&amp;&#39;&quot;?z"),
        "{}",
        card(&page, 1)
    );
    assert!(!page.contains("<s>") && !page.contains('\u{202e}'));
    drop(server);
}

/// Served by another user who cannot see into the stranger's process
/// (hidepid=2): what can be known, and still never free.
fn one_who_cannot_see_the_process_is_told_in_use(scene: &Scene, stranger: u32) {
    let hidden = Server::start(&mut scene.devlock_as(USER_B, true), &[]);
    let page = hidden.get("/").body;
    let gpu1 = card(&page, 1);
    assert_eq!(card_class(&page, 1), "gpu outside", "{gpu1}");
    assert!(
        gpu1.contains("user hidden")
            && gpu1.contains("11.7 GiB")
            && gpu1.contains(&format!("pid {stranger}"))
            && !gpu1.contains("nobody"),
        "{gpu1}"
    );
    drop(hidden);
    let out = scene
        .devlock_as(USER_B, true)
        .arg("status")
        .output()
        .unwrap();
    let table = stdout(&out);
    let row1 = row(&table, "gpu:1");
    assert!(
        row1.contains("in use") && row1.contains("user unknown") && row1.contains("11.7 GiB"),
        "{table}"
    );
}

test!(the_legend_names_each_colour_the_page_uses, needs: [Root, Tool("setpriv"), Tool("unshare"), Tool("cc"), Tool("chromium-headless-shell")]);
pub(crate) fn the_legend_names_each_colour_the_page_uses() {
    let scene = Scene::new();
    let server = Server::start(&mut scene.devlock(), &[]);
    let chromium = which("chromium-headless-shell");
    let dom = dump_dom(&chromium, &scene.s.work("chromium"), &server.url("/"));
    let legend = dom
        .split("<section class=\"legend\"")
        .nth(1)
        .and_then(|rest| rest.split("</section>").next())
        .unwrap_or_else(|| panic!("no legend in {dom}"));
    let style = dom
        .split("<style>")
        .nth(1)
        .and_then(|rest| rest.split("</style>").next())
        .unwrap();
    // Every colour the style paints with (the page's own neutral ones
    // aside)...
    let neutral = ["bg", "card", "text", "dim", "line", "track"];
    let mut colours: Vec<&str> = style
        .split("var(--")
        .skip(1)
        .filter_map(|rest| rest.split(')').next())
        .filter(|name| !neutral.contains(name))
        .collect();
    colours.sort_unstable();
    colours.dedup();
    // ...and every state a card of this page is painted in.
    let mut painted: Vec<String> = (0..3).map(|i| card_class(&dom, i)).collect();
    painted.dedup();
    assert!(colours.len() >= 7, "{colours:?}");
    for colour in colours.iter().map(|c| c.to_string()).chain(
        painted
            .iter()
            .map(|c| c.trim_start_matches("gpu ").to_owned()),
    ) {
        let key = format!("<span class=\"key {colour}\"></span>");
        let words = legend
            .split(&key)
            .nth(1)
            .and_then(|rest| rest.split("</span>").next())
            .unwrap_or_else(|| panic!("{colour} is not in the legend: {legend}"));
        assert!(words.len() > 3, "{colour}: {words:?}");
    }
    // The strip's labels, and the policy in force.
    assert!(
        dom.contains("Site policy") && dom.contains("Idle timeout</b>: 2h"),
        "{dom}"
    );
}

test!(per_user_totals_on_the_page_match_report, needs: [Root, Tool("setpriv"), Tool("unshare"), Tool("cc")]);
pub(crate) fn per_user_totals_on_the_page_match_report() {
    let scene = Scene::new();
    a_day_of_records(&scene);
    let (report, reported) = report_by_user(&scene);
    assert_eq!(
        reported.len(),
        5,
        "a header, three users, the total:\n{report}"
    );
    // The page, whose records are read when it is first asked for.
    let server = Server::start(&mut scene.devlock(), &[]);
    let page = server.get("/").body;
    let (users, shown) = users_table(&page);
    assert_eq!(shown, reported, "the page:\n{users}\nthe report:\n{report}");
    the_strip_is_labelled_every_six_hours(&page);
    let nobody = reported.iter().find(|r| r[0] == "nobody").unwrap();
    assert_eq!(nobody[1], "1", "{report}");
    let idle = reported
        .iter()
        .find(|r| r[0] == USER_B.to_string())
        .unwrap();
    assert_eq!(
        (idle[3].as_str(), idle[8].as_str()),
        ("8%", "1 idle"),
        "{report}"
    );
}

/// Records over the last day: real holds by root and USER_A, and one of
/// USER_B's from five hours ago that was stopped idle.
fn a_day_of_records(scene: &Scene) {
    let s = &scene.s;
    std::fs::set_permissions(s.usage_dir(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    for uid in [0, USER_A, 0] {
        let out = scene
            .devlock_as(uid, false)
            .args(["--step", "short", "gpu:2", "--", "true"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
    }
    let now = now_ms();
    let mut text = start_line(
        "past",
        "overnight",
        &["gpu:2"],
        &[2],
        now - 5 * H,
        90,
        Some(4096),
    );
    text += &end_line("past", now - 3 * H, "idle", 600, 6600, 7200, Some(3000));
    let file = s.usage_dir().join(format!("{USER_B}.jsonl"));
    std::fs::write(&file, text).unwrap();
    std::os::unix::fs::chown(&file, Some(USER_B), Some(USER_B)).unwrap();
}

/// `report --by user --since 24h`, and its rows split into cells.
fn report_by_user(scene: &Scene) -> (String, Vec<Vec<String>>) {
    let out = scene
        .devlock()
        .args(["report", "--by", "user", "--since", "24h"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let report = stdout(&out);
    let reported: Vec<Vec<String>> = report
        .lines()
        .map(|l| {
            l.split("  ")
                .map(str::trim)
                .filter(|c| !c.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .collect();
    (report, reported)
}

/// The page's users' table, and its rows' cells.
fn users_table(page: &str) -> (&str, Vec<Vec<String>>) {
    let users = page
        .split("<table class=\"report\">")
        .nth(1)
        .and_then(|rest| rest.split("</table>").next())
        .unwrap_or_else(|| panic!("no users' table in {page}"));
    let cells = |row: &str| -> Vec<String> {
        row.split("<td>")
            .skip(1)
            .chain(row.split("<th>").skip(1))
            .map(|c| c.split('<').next().unwrap().to_owned())
            .collect()
    };
    let shown: Vec<Vec<String>> = users
        .split("</tr>")
        .filter(|r| r.contains("<t"))
        .map(cells)
        .collect();
    (users, shown)
}

/// gpu:2's last day, under its strip: the UTC hours every six hours from a
/// day ago, then now.
fn the_strip_is_labelled_every_six_hours(page: &str) {
    let gpu2 = card(page, 2);
    let ticks: Vec<&str> = gpu2
        .split("<div class=\"ticks\">")
        .nth(1)
        .and_then(|rest| rest.split("</div>").next())
        .unwrap_or_else(|| panic!("no labels under the strip: {gpu2}"))
        .split("</span>")
        .filter_map(|t| t.rsplit('>').next())
        .filter(|t| !t.is_empty())
        .collect();
    assert_eq!(ticks.len(), 5, "{ticks:?}");
    assert_eq!(ticks[4], "now", "{ticks:?}");
    let minutes = |t: &str| -> u32 {
        let (h, m) = t[..5].split_once(':').unwrap();
        h.parse::<u32>().unwrap() * 60 + m.parse::<u32>().unwrap()
    };
    assert!(ticks[0].ends_with(" UTC"), "{ticks:?}");
    for pair in ticks[..4].windows(2) {
        assert_eq!(
            (minutes(pair[1]) + 1440 - minutes(pair[0])) % 1440,
            360,
            "{ticks:?}"
        );
    }
}

test!(a_gpu_whose_processes_are_unknown_is_not_called_free, needs: [Tool("cc")]);
pub(crate) fn a_gpu_whose_processes_are_unknown_is_not_called_free() {
    let s = Scratch::new();
    // GPU 1's process list is refused (NVML_ERROR_NO_PERMISSION); GPU 2's
    // is empty.
    let text = format!("{SCENARIO}error nvmlDeviceGetComputeRunningProcesses_v3 1 4\n");
    let library = fake_nvml(&s, &text);
    for name in ["gpu:1", "gpu:2"] {
        let out = with_nvml(&s, &library, &[])
            .args(["--new", name, "--", "true"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
    }
    let server = Server::start(&mut with_nvml(&s, &library, &[]), &[]);
    let page = server.get("/").body;
    assert_eq!(card_class(&page, 1), "gpu unknown", "{}", card(&page, 1));
    assert!(
        card(&page, 1).contains("<span class=\"state\">lock free, use unknown</span>")
            && card(&page, 1).contains("processes</th><td colspan=\"4\">unknown: "),
        "{}",
        card(&page, 1)
    );
    assert_eq!(card_class(&page, 2), "gpu free", "{}", card(&page, 2));
}
