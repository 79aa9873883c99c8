//! `/` in a real headless browser: its DOM, and a screenshot left as an
//! artefact.

use super::*;

/// The DOM after chromium has loaded `url`.
pub fn dump_dom(chromium: &Path, user_data: &Path, url: &str) -> String {
    let out = browser(chromium, user_data, &["--dump-dom", url]);
    String::from_utf8(out).unwrap()
}

/// The headless browser, as root needs it, with a profile of its own.
fn browser(chromium: &Path, user_data: &Path, args: &[&str]) -> Vec<u8> {
    let mut child = Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", user_data.display()))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = Vec::new();
    child.stdout.take().unwrap().read_to_end(&mut out).unwrap();
    let status = wait_child(&mut child);
    assert!(status.success(), "{chromium:?} {args:?}: {status}");
    out
}

/// Where the test leaves its screenshot: the target directory's tmp.
pub fn artefact(name: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(name)
}

/// Takes a screenshot of `url` into `png`, `width` by `height`.
pub fn screenshot(chromium: &Path, user_data: &Path, url: &str, png: &Path, size: (u32, u32)) {
    let _ = std::fs::remove_file(png);
    browser(
        chromium,
        user_data,
        &[
            &format!("--window-size={},{}", size.0, size.1),
            &format!("--screenshot={}", png.display()),
            url,
        ],
    );
    let bytes = std::fs::read(png).unwrap();
    assert!(
        bytes.starts_with(b"\x89PNG\r\n\x1a\n") && bytes.len() > 4096,
        "{} is no screenshot",
        png.display()
    );
}

const CHROMIUM: &str = "chromium-headless-shell";

test!(the_page_in_a_headless_browser_shows_the_holder_and_the_line, needs: [Tool("cc"), Tool("chromium-headless-shell")]);
pub(crate) fn the_page_in_a_headless_browser_shows_the_holder_and_the_line() {
    let scene = Scene::new();
    let server = scene.serve();
    let page = server.get("/");
    assert_eq!(
        page.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    let csp = page.header("content-security-policy").unwrap();
    assert!(csp.contains("default-src 'none'"), "{csp}");
    assert!(
        !page.body.contains("<script") && !page.body.contains("src=\"http"),
        "nothing to run, nothing fetched: {}",
        page.body
    );
    let chromium = which(CHROMIUM);
    let profile = scene.s.work("chromium");
    let dom = dump_dom(&chromium, &profile, &server.url("/"));
    // The browser built the page: gpu:0's card names its holder and its line.
    let card = dom
        .split("id=\"gpu-0\"")
        .nth(1)
        .and_then(|rest| rest.split("</article>").next())
        .unwrap_or_else(|| panic!("no card for gpu:0 in {dom}"));
    assert!(card.contains("<b>train</b>"), "{card}");
    assert!(
        card.contains("waits #1") && card.contains("<b>eval</b>"),
        "{card}"
    );
    assert!(
        card.contains("NVIDIA H100 80GB HBM3") && card.contains("97% busy"),
        "{card}"
    );
    let gpu2 = dom.split("id=\"gpu-2\"").nth(1).unwrap();
    assert!(
        gpu2.split("</article>")
            .next()
            .unwrap()
            .contains("NOT GATED"),
        "{gpu2}"
    );
    assert!(
        dom.contains("<b>solver</b>") && dom.contains("Other locks in use"),
        "{dom}"
    );
    assert!(dom.contains("http-equiv=\"refresh\""), "{dom}");
    let png = artefact("serve-page.png");
    screenshot(&chromium, &profile, &server.url("/"), &png, (1280, 900));
    eprintln!("the page, as chromium shows it: {}", png.display());
}

/// The full path of `program` on PATH.
pub fn which(program: &str) -> PathBuf {
    std::env::split_paths(&std::env::var_os("PATH").unwrap())
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{program} is not on PATH"))
}
