//! The etcd backend over TLS, against real etcd servers and a test CA made
//! here with openssl: the server's certificate checked, client
//! certificates, passwords over TLS, and every way it can go wrong said in
//! one line that names the file, with its exit code.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use crate::etcd::name;
use crate::etcd_server::{EtcdServer, shared_etcd};
use crate::harness::*;

/// A CA of the test's own, and what it signs: files in `dir`.
struct TestCa {
    dir: PathBuf,
}

impl TestCa {
    fn new(dir: &Path) -> TestCa {
        std::fs::create_dir_all(dir).unwrap();
        let ca = TestCa {
            dir: dir.to_owned(),
        };
        ca.self_signed("ca", "devlock-test-ca");
        ca.self_signed("other-ca", "another-ca");
        // `openssl ca` signs with any validity, a past one included.
        std::fs::create_dir(dir.join("db")).unwrap();
        std::fs::write(dir.join("db/index.txt"), "").unwrap();
        std::fs::write(dir.join("db/serial"), "01\n").unwrap();
        std::fs::write(
            dir.join("ca.cnf"),
            "[ca]\ndefault_ca = test\n[test]\ndir = db\ndatabase = db/index.txt\n\
             new_certs_dir = db\nserial = db/serial\ndefault_md = sha256\npolicy = any\n\
             copy_extensions = none\nunique_subject = no\n[any]\ncommonName = supplied\n\
             [server]\nsubjectAltName = IP:127.0.0.1,DNS:localhost\n\
             extendedKeyUsage = serverAuth,clientAuth\n[client]\nextendedKeyUsage = clientAuth\n",
        )
        .unwrap();
        ca
    }

    fn path(&self, file: &str) -> String {
        self.dir.join(file).display().to_string()
    }

    fn openssl(&self, args: &[&str]) {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .output()
            .expect("openssl (Debian package openssl)");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn new_key(&self, name: &str) {
        let key = format!("{name}.key");
        self.openssl(&[
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out",
            &key,
        ]);
        std::fs::set_permissions(self.dir.join(&key), std::fs::Permissions::from_mode(0o600))
            .unwrap();
    }

    fn self_signed(&self, name: &str, cn: &str) {
        self.new_key(name);
        let (key, crt, subj) = (
            format!("{name}.key"),
            format!("{name}.crt"),
            format!("/CN={cn}"),
        );
        self.openssl(&[
            "req", "-x509", "-key", &key, "-out", &crt, "-days", "2", "-subj", &subj,
        ]);
    }

    /// A certificate for `name` (its key in NAME.key, made here) signed by
    /// the CA `by`, with the extensions of section `kind` (server or
    /// client), valid from `start` to `end` (openssl's YYMMDDHHMMSSZ), or
    /// for two days from now.
    fn sign(&self, name: &str, cn: &str, by: &str, kind: &str, dates: Option<(&str, &str)>) {
        self.new_key(name);
        let (key, csr, crt) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.crt"),
        );
        self.openssl(&[
            "req",
            "-new",
            "-key",
            &key,
            "-out",
            &csr,
            "-subj",
            &format!("/CN={cn}"),
        ]);
        let (cert, cakey) = (format!("{by}.crt"), format!("{by}.key"));
        let mut args = vec![
            "ca",
            "-batch",
            "-notext",
            "-config",
            "ca.cnf",
            "-cert",
            &cert,
            "-keyfile",
            &cakey,
            "-in",
            &csr,
            "-out",
            &crt,
            "-extensions",
            kind,
        ];
        match dates {
            Some((start, end)) => args.extend(["-startdate", start, "-enddate", end]),
            None => args.extend(["-days", "2"]),
        }
        self.openssl(&args);
    }
}

fn devlock(s: &Scratch, url: &str) -> Command {
    let mut cmd = crate::etcd::devlock(s, url);
    for var in ["DEVLOCK_ETCD_CA", "DEVLOCK_ETCD_CERT", "DEVLOCK_ETCD_KEY"] {
        cmd.env_remove(var);
    }
    cmd
}

fn run(s: &Scratch, url: &str, args: &[&str]) -> Output {
    devlock(s, url)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// A run that must fail with `code`, in one line containing `says`.
fn fails(s: &Scratch, url: &str, args: &[&str], code: i32, says: &str) {
    let out = run(s, url, args);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
    assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
    assert!(
        err.starts_with("devlock: ") && err.contains(says),
        "{args:?}: {err}"
    );
}

fn server_files(ca: &TestCa) -> Vec<String> {
    vec![
        "--cert-file".into(),
        ca.path("server.crt"),
        "--key-file".into(),
        ca.path("server.key"),
    ]
}

test!(etcd_tls_checks_the_servers_certificate_and_carries_a_password, needs: [Tool("etcd"), Tool("etcdctl"), Tool("openssl")]);
pub(crate) fn etcd_tls_checks_the_servers_certificate_and_carries_a_password() {
    let s = Scratch::new();
    let ca = TestCa::new(&s.work("pki"));
    ca.sign("server", "etcd", "ca", "server", None);
    ca.sign(
        "stale",
        "etcd",
        "ca",
        "server",
        Some(("200101000000Z", "200102000000Z")),
    );
    let files = server_files(&ca);
    let server = EtcdServer::start_tls(&files.iter().map(String::as_str).collect::<Vec<_>>());
    let url = server.url.clone();
    let r = name("tls");
    let ca_file = ca.path("ca.crt");
    takes_with_the_ca_from_a_flag_or_the_environment(&s, &url, &r, &ca_file);
    a_wrong_ca_or_a_plain_server_is_one_line(&s, &ca, &url, &r, &ca_file);
    an_expired_server_certificate_is_named(&s, &ca, &r, &ca_file);
    a_password_is_carried_over_tls(&s, &url, &r, &ca_file);
}

/// The server checked against the CA given by `--etcd-ca`, then by
/// `DEVLOCK_ETCD_CA` with a bare HOST:PORT.
fn takes_with_the_ca_from_a_flag_or_the_environment(
    s: &Scratch,
    url: &str,
    r: &str,
    ca_file: &str,
) {
    let out = run(
        s,
        url,
        &[
            "--etcd-ca",
            ca_file,
            r,
            "--",
            "sh",
            "-c",
            "echo in $DEVLOCK_FENCE",
        ],
    );
    assert!(stdout(&out).starts_with("in "), "{}", stderr(&out));
    // The same from the environment, and HOST:PORT meaning https:// then.
    let bare = url.trim_start_matches("https://");
    let out = devlock(s, bare)
        .env("DEVLOCK_ETCD_CA", ca_file)
        .args([r, "--", "echo", "env"])
        .output()
        .unwrap();
    assert_eq!(stdout(&out), "env\n", "{}", stderr(&out));
}

/// Another CA, no CA, a plain server, a TLS server asked in plain, a file
/// that is no PEM: each one line with its exit code.
fn a_wrong_ca_or_a_plain_server_is_one_line(
    s: &Scratch,
    ca: &TestCa,
    url: &str,
    r: &str,
    ca_file: &str,
) {
    let other = ca.path("other-ca.crt");
    fails(
        s,
        url,
        &["--etcd-ca", &other, r, "--", "true"],
        78,
        &format!("does not verify against {other}"),
    );
    fails(s, url, &[r, "--", "true"], 78, "CA certificates");
    let out = run(s, url, &["--etcd-ca", ca_file, "status"]);
    assert!(
        stdout(&out).contains("(TLS: server checked against"),
        "{}",
        stderr(&out)
    );
    let plain = url.replace("https://", "http://");
    fails(s, &plain, &[r, "--", "true"], 78, "answers in TLS");
    fails(s, &plain, &["status"], 78, "answers in TLS");
    let (_shared, plain_etcd) = shared_etcd();
    let wrong_way = plain_etcd.replace("http://", "https://");
    fails(
        s,
        &wrong_way,
        &["--etcd-ca", ca_file, r, "--", "true"],
        78,
        "does not answer in TLS",
    );
    let not_pem = ca.path("ca.cnf");
    fails(
        s,
        url,
        &["--etcd-ca", &not_pem, r, "--", "true"],
        78,
        &not_pem,
    );
    fails(
        s,
        &plain_etcd,
        &["--etcd-ca", ca_file, r, "--", "true"],
        2,
        "https://",
    );
}

fn an_expired_server_certificate_is_named(s: &Scratch, ca: &TestCa, r: &str, ca_file: &str) {
    // A server whose certificate expired.
    let stale_files = [
        "--cert-file".to_owned(),
        ca.path("stale.crt"),
        "--key-file".to_owned(),
        ca.path("stale.key"),
    ];
    let stale = EtcdServer::start_tls(&stale_files.iter().map(String::as_str).collect::<Vec<_>>());
    fails(
        s,
        &stale.url,
        &["--etcd-ca", ca_file, r, "--", "true"],
        78,
        "expired on 2020-01-02",
    );
    drop(stale);
}

fn a_password_is_carried_over_tls(s: &Scratch, url: &str, r: &str, ca_file: &str) {
    // A password, over TLS.
    let etcdctl = |args: &[&str]| {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", url, "--cacert", ca_file])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    etcdctl(&["user", "add", "root:rootpw"]);
    etcdctl(&["auth", "enable"]);
    let with_user = |user: &str, args: &[&str]| {
        devlock(s, url)
            .env("DEVLOCK_ETCD_USER", user)
            .args(["--etcd-ca", ca_file])
            .args(args)
            .output()
            .unwrap()
    };
    let out = with_user("root:rootpw", &[r, "--", "echo", "user"]);
    assert_eq!(stdout(&out), "user\n", "{}", stderr(&out));
    let out = with_user("root:wrong", &[r, "--", "true"]);
    assert_eq!(out.status.code(), Some(77), "{}", stderr(&out));
    let table = stdout(&with_user("root:rootpw", &["status"]));
    assert!(
        table.contains(&format!("server checked against {ca_file}")) && table.contains("user root"),
        "{table}"
    );
}

test!(etcd_tls_client_certificates_are_checked_here_and_by_etcd, needs: [Tool("etcd"), Tool("etcdctl"), Tool("openssl")]);
pub(crate) fn etcd_tls_client_certificates_are_checked_here_and_by_etcd() {
    let s = Scratch::new();
    let ca = TestCa::new(&s.work("pki"));
    ca.sign("server", "etcd", "ca", "server", None);
    ca.sign("client", "devlock-client", "ca", "client", None);
    ca.sign(
        "expired",
        "devlock-client",
        "ca",
        "client",
        Some(("200101000000Z", "200102000000Z")),
    );
    ca.sign("stranger", "stranger", "other-ca", "client", None);
    let mut files = server_files(&ca);
    files.extend([
        "--client-cert-auth".into(),
        "--trusted-ca-file".into(),
        ca.path("ca.crt"),
    ]);
    let server = EtcdServer::start_tls(&files.iter().map(String::as_str).collect::<Vec<_>>());
    let url = server.url.clone();
    let r = name("mtls");
    let good = client_files(&ca, "client", "client");
    a_good_client_certificate_takes_and_is_shown(&s, &ca, &url, &r, &good);
    bad_client_certificates_are_refused_in_one_line(&s, &ca, &url, &r, &good);
    let out = run(
        &s,
        &url,
        &argv_of(&good, &[&r, "--", "true"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
}

/// `--etcd-ca` with the client certificate `cert` and the key `key`.
fn client_files(ca: &TestCa, cert: &str, key: &str) -> Vec<String> {
    vec![
        "--etcd-ca".to_owned(),
        ca.path("ca.crt"),
        "--etcd-cert".to_owned(),
        ca.path(&format!("{cert}.crt")),
        "--etcd-key".to_owned(),
        ca.path(&format!("{key}.key")),
    ]
}

fn argv_of(tls: &[String], rest: &[&str]) -> Vec<String> {
    tls.iter()
        .cloned()
        .chain(rest.iter().map(|s| s.to_string()))
        .collect()
}

/// A take with a good certificate, and status naming it.
fn a_good_client_certificate_takes_and_is_shown(
    s: &Scratch,
    ca: &TestCa,
    url: &str,
    r: &str,
    good: &[String],
) {
    let argv = argv_of(good, &[r, "--", "sh", "-c", "echo $DEVLOCK_FENCE"]);
    let out = run(s, url, &argv.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        stdout(&out).trim().parse::<i64>().is_ok(),
        "{}",
        stderr(&out)
    );
    let argv = argv_of(good, &["status", "--json"]);
    let out = run(s, url, &argv.iter().map(String::as_str).collect::<Vec<_>>());
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["tls"]["subject"], "CN=devlock-client", "{json}");
    assert_eq!(json["tls"]["cert"], ca.path("client.crt"), "{json}");
    let argv = argv_of(good, &["status"]);
    let table = stdout(&run(
        s,
        url,
        &argv.iter().map(String::as_str).collect::<Vec<_>>(),
    ));
    assert!(
        table.contains("client certificate CN=devlock-client"),
        "{table}"
    );
}

/// No certificate, another CA's, an expired one, a key that does not match
/// or that others can read, a certificate without its key.
fn bad_client_certificates_are_refused_in_one_line(
    s: &Scratch,
    ca: &TestCa,
    url: &str,
    r: &str,
    good: &[String],
) {
    let ca_file = ca.path("ca.crt");
    let check = |tls: &[String], code: i32, says: &str| {
        let argv = argv_of(tls, &[r, "--", "true"]);
        fails(
            s,
            url,
            &argv.iter().map(String::as_str).collect::<Vec<_>>(),
            code,
            says,
        );
    };

    check(
        &["--etcd-ca".to_owned(), ca_file.clone()],
        77,
        "wants a client certificate",
    );
    check(
        &client_files(ca, "stranger", "stranger"),
        77,
        &format!("refused the client certificate {}", ca.path("stranger.crt")),
    );
    check(
        &client_files(ca, "expired", "expired"),
        78,
        &format!("{} expired on 2020-01-02", ca.path("expired.crt")),
    );
    check(
        &client_files(ca, "client", "stranger"),
        78,
        &format!("the key {} does not match", ca.path("stranger.key")),
    );
    for mode in [0o644, 0o640, 0o604] {
        std::fs::set_permissions(
            ca.dir.join("client.key"),
            std::fs::Permissions::from_mode(mode),
        )
        .unwrap();
        check(
            good,
            78,
            &format!(
                "the private key {} can be read by others",
                ca.path("client.key")
            ),
        );
    }
    std::fs::set_permissions(
        ca.dir.join("client.key"),
        std::fs::Permissions::from_mode(0o400),
    )
    .unwrap();
    let cert_only = vec![
        "--etcd-ca".to_owned(),
        ca_file.clone(),
        "--etcd-cert".to_owned(),
        ca.path("client.crt"),
    ];
    check(&cert_only, 2, "go together");
}
