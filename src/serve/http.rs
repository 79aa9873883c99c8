//! The HTTP/1.1 under `devlock serve`, on std alone: GET and HEAD, one
//! request per connection, each bounded in size; what a request's head may
//! be and how an answer is written ([`super::conns`] keeps the connections,
//! their deadlines and their number).
//!
//! Why not a crate: serve answers three fixed paths with small bodies it
//! has in memory, to Prometheus and browsers, one request per connection.
//! What that needs of HTTP is a request line, the Host header and a
//! response with a length; what a general server brings (keep-alive and
//! pipelining, chunked bodies, request bodies at all, an async runtime) is
//! parsing surface this tool would expose to every local user without
//! using it. tiny_http would add four crates for it, hyper a runtime; the
//! whole of this file is read in one sitting and its limits are its own.
//!
//! **What it reads** (RFC 9112): a request line `METHOD SP TARGET SP
//! HTTP/1.x` (empty lines before it skipped), header fields `name: value`,
//! an empty line; lines end in CRLF or a bare LF. Refused: more than
//! [`MAX_HEAD`] bytes or [`MAX_FIELDS`] fields (431), a request not read
//! whole in time (408, [`super::conns::READ_TIME`]), a method other than
//! GET and HEAD (405,
//! with `Allow`), a version other than 1.0 and 1.1 (505), and as 400 a
//! malformed line, obsolete line folding, whitespace before a field's
//! colon, control characters, a repeated Host or, in HTTP/1.1, none, and any
//! body (`Content-Length` other than 0, `Transfer-Encoding`). The target is
//! a path (origin form, or absolute form whose path is taken); a query is
//! ignored.
//!
//! **What it writes:** `HTTP/1.1`, `Date`, `Content-Type`, `Content-Length`,
//! `Cache-Control: no-store`, `X-Content-Type-Options: nosniff`,
//! `Connection: close`, the handler's own headers, and the body (none for
//! HEAD). The socket writes do not raise SIGPIPE (std sends with
//! `MSG_NOSIGNAL`), so a client that goes away costs a failed write, not
//! the process.
//!
//! **Whose Host:** listening on a loopback address, a request naming any
//! Host but `localhost`, a name under `.localhost` or an IP address is
//! refused (403): a page elsewhere could otherwise point a name of its own
//! at 127.0.0.1 (DNS rebinding) and read the answers from the victim's
//! browser. Listening elsewhere, the address was chosen to be reached, and
//! any Host is answered.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::SystemTime;

use crate::messages::serve as words;

/// The most bytes of request line and header fields read.
pub(crate) const MAX_HEAD: usize = 8 * 1024;
/// The most header fields read.
pub(crate) const MAX_FIELDS: usize = 64;

/// The methods served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Method {
    Get,
    Head,
}

/// A request as far as serve needs one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Request {
    pub(crate) method: Method,
    /// The target's path, without its query.
    pub(crate) path: String,
    pub(crate) host: Option<String>,
}

/// An answer: its status, type, extra headers and body.
#[derive(Debug)]
pub(crate) struct Response {
    pub(crate) status: u16,
    pub(crate) content_type: &'static str,
    pub(crate) headers: Vec<(&'static str, String)>,
    pub(crate) body: Vec<u8>,
}

impl Response {
    pub(crate) fn new(status: u16, content_type: &'static str, body: impl Into<Vec<u8>>) -> Self {
        Response {
            status,
            content_type,
            headers: Vec::new(),
            body: body.into(),
        }
    }

    /// A plain-text answer (errors and refusals).
    pub(crate) fn text(status: u16, body: String) -> Self {
        Response::new(status, "text/plain; charset=utf-8", body)
    }

    pub(crate) fn with(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }
}

/// What answers a request.
pub(crate) type Handler = Arc<dyn Fn(&Request) -> Response + Send + Sync>;

/// Where the head ends in `bytes` (just past its empty line), if it does.
/// Empty lines before the request line do not end it.
pub(crate) fn head_end(bytes: &[u8]) -> Option<usize> {
    bytes
        .windows(2)
        .enumerate()
        .filter(|(_, w)| w == b"\n\n")
        .map(|(i, _)| i + 2)
        .chain(
            bytes
                .windows(4)
                .enumerate()
                .filter(|(_, w)| w == b"\r\n\r\n")
                .map(|(i, _)| i + 4),
        )
        .min()
}

/// Reads a head into a request, or the answer that refuses it.
pub(crate) fn parse(head: &[u8]) -> Result<Request, Response> {
    let bad = |why: &str| Response::text(400, words::bad_request(why));
    let text = std::str::from_utf8(head).map_err(|_| bad("it is not text"))?;
    let mut lines = text
        .split('\n')
        .map(|l| l.strip_suffix('\r').unwrap_or(l))
        .skip_while(|l| l.is_empty());
    let request_line = lines.next().ok_or_else(|| bad("it is empty"))?;
    let parts: Vec<&str> = request_line.split(' ').collect();
    let [method, target, version] = parts[..] else {
        return Err(bad("its first line is not METHOD TARGET HTTP/1.1"));
    };
    let http11 = match version {
        "HTTP/1.1" => true,
        "HTTP/1.0" => false,
        v if v.starts_with("HTTP/") => {
            return Err(Response::text(
                505,
                words::bad_request("it is not HTTP/1.0 or HTTP/1.1"),
            ));
        }
        _ => return Err(bad("its first line is not METHOD TARGET HTTP/1.1")),
    };
    let method = match method {
        "GET" => Method::Get,
        "HEAD" => Method::Head,
        other if !other.is_empty() && other.bytes().all(is_token_byte) => {
            return Err(Response::text(405, words::read_only(other)).with("Allow", "GET, HEAD"));
        }
        _ => return Err(bad("its method is not a word")),
    };
    let path = path_of(target).ok_or_else(|| bad("its target is not a path"))?;
    let mut host = None;
    let mut fields = 0;
    for line in lines.take_while(|l| !l.is_empty()) {
        fields += 1;
        if fields > MAX_FIELDS {
            return Err(Response::text(
                431,
                words::bad_request("it has too many header fields"),
            ));
        }
        if line.starts_with([' ', '\t']) {
            return Err(bad("it folds a header field over lines"));
        }
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| bad("a header field has no colon"))?;
        if name.is_empty() || !name.bytes().all(is_token_byte) {
            return Err(bad("a header field's name is not a word"));
        }
        if value.bytes().any(|b| b != b'\t' && (b < 0x20 || b == 0x7f)) {
            return Err(bad("a header field holds a control character"));
        }
        let value = value.trim_matches([' ', '\t']);
        if name.eq_ignore_ascii_case("host") {
            if host.replace(value.to_owned()).is_some() {
                return Err(bad("it names two hosts"));
            }
        } else if name.eq_ignore_ascii_case("transfer-encoding")
            || (name.eq_ignore_ascii_case("content-length") && value != "0")
        {
            return Err(bad("a GET or HEAD has no body"));
        }
    }
    if http11 && host.is_none() {
        return Err(bad("HTTP/1.1 needs a Host header field"));
    }
    Ok(Request { method, path, host })
}

/// A tchar of RFC 9110.
fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// The path of a request target, without its query: origin form
/// (`/metrics?x`), or absolute form (`http://host:port/metrics`).
fn path_of(target: &str) -> Option<String> {
    let rest = match target.split_once("://") {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("http") => {
            rest.find('/').map_or("/", |at| &rest[at..])
        }
        Some(_) => return None,
        None => target,
    };
    if !rest.starts_with('/') || rest.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return None;
    }
    let path = rest.split(['?', '#']).next().unwrap_or(rest);
    Some(path.to_owned())
}

/// Whether a Host names this machine by a name no other site can point
/// here: `localhost`, a name under `.localhost` (RFC 6761), or an IP
/// address, with or without a port.
pub(crate) fn is_local_host(host: &str) -> bool {
    let name = if let Some(v6) = host.strip_prefix('[') {
        let Some((address, rest)) = v6.split_once(']') else {
            return false;
        };
        if !(rest.is_empty() || rest.strip_prefix(':').is_some_and(is_port)) {
            return false;
        }
        return address.parse::<std::net::Ipv6Addr>().is_ok();
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) if is_port(port) => name,
            Some(_) => return false,
            None => host,
        }
    };
    let lower = name.trim_end_matches('.').to_ascii_lowercase();
    lower == "localhost" || lower.ends_with(".localhost") || lower.parse::<IpAddr>().is_ok()
}

fn is_port(text: &str) -> bool {
    !text.is_empty() && text.len() <= 5 && text.bytes().all(|b| b.is_ascii_digit())
}

/// The status line and header fields of `response`, sent at `now`.
pub(crate) fn head(response: &Response, now: SystemTime) -> Vec<u8> {
    let mut head = format!(
        "HTTP/1.1 {} {}\r\nDate: {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n\
         Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\nConnection: close\r\n",
        response.status,
        reason(response.status),
        http_date(now),
        response.content_type,
        response.body.len()
    );
    for (name, value) in &response.headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    head.into_bytes()
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        505 => "HTTP Version Not Supported",
        _ => "",
    }
}

/// `Tue, 01 Dec 2026 09:05:00 GMT` (RFC 9110's IMF-fixdate).
fn http_date(t: SystemTime) -> String {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let days = secs / 86_400;
    let (hour, minute, second) = (secs % 86_400 / 3600, secs % 3600 / 60, secs % 60);
    // Days to a civil date (Howard Hinnant's algorithm), from 1970-01-01.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    const WEEKDAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    format!(
        "{}, {day:02} {} {year} {hour:02}:{minute:02}:{second:02} GMT",
        WEEKDAYS[(days % 7) as usize],
        MONTHS[(month - 1) as usize]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(head: &str) -> Result<Request, u16> {
        parse(head.as_bytes()).map_err(|r| r.status)
    }

    #[test]
    fn a_plain_get_and_head_are_read() {
        let r =
            request("GET /metrics?x=1 HTTP/1.1\r\nHost: 127.0.0.1:10425\r\nAccept: */*\r\n\r\n")
                .unwrap();
        assert_eq!(r.method, Method::Get);
        assert_eq!(r.path, "/metrics");
        assert_eq!(r.host.as_deref(), Some("127.0.0.1:10425"));
        let r = request("\r\nHEAD http://localhost:1/status.json HTTP/1.0\n\n").unwrap();
        assert_eq!(
            (r.method, r.path.as_str(), r.host),
            (Method::Head, "/status.json", None)
        );
    }

    #[test]
    fn malformed_requests_are_refused_with_their_status() {
        let cases = [
            ("POST / HTTP/1.1\r\nHost: x\r\n\r\n", 405),
            ("DELETE /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 405),
            ("GET / HTTP/2.0\r\nHost: x\r\n\r\n", 505),
            ("GET / HTTP/1.1\r\n\r\n", 400),
            ("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
            ("GET / HTTP/1.1\r\nHost : a\r\n\r\n", 400),
            ("GET / HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n", 400),
            ("GET / HTTP/1.1\r\nHost: a\r\nX: \x01\r\n\r\n", 400),
            (
                "GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\n",
                400,
            ),
            (
                "GET / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n",
                400,
            ),
            ("GET  / HTTP/1.1\r\nHost: a\r\n\r\n", 400),
            ("GET * HTTP/1.1\r\nHost: a\r\n\r\n", 400),
            ("GET ftp://x/ HTTP/1.1\r\nHost: a\r\n\r\n", 400),
            ("GET / HTTP/1.1\r\nno colon\r\n\r\n", 400),
            ("G(T / HTTP/1.1\r\nHost: a\r\n\r\n", 400),
        ];
        for (head, status) in cases {
            assert_eq!(request(head).err(), Some(status), "{head:?}");
        }
        let many: String = (0..=MAX_FIELDS).map(|i| format!("X-{i}: y\r\n")).collect();
        assert_eq!(
            request(&format!("GET / HTTP/1.1\r\nHost: a\r\n{many}\r\n")).err(),
            Some(431)
        );
        assert!(request("GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n").is_ok());
    }

    #[test]
    fn the_head_ends_at_its_first_empty_line() {
        assert_eq!(head_end(b"GET / HTTP/1.0\r\n\r\nrest"), Some(18));
        assert_eq!(head_end(b"GET / HTTP/1.0\n\nrest"), Some(16));
        assert_eq!(head_end(b"GET / HTTP/1.0\r\nHost: x\r\n"), None);
    }

    #[test]
    fn only_names_no_other_site_can_point_here_are_local() {
        for host in [
            "localhost",
            "localhost:10425",
            "LOCALHOST.",
            "grafana.localhost:80",
            "127.0.0.1",
            "127.0.0.1:10425",
            "[::1]:10425",
            "[::1]",
            "10.0.0.5:10425",
        ] {
            assert!(is_local_host(host), "{host}");
        }
        for host in [
            "example.org",
            "evil.example:10425",
            "localhost.evil.example",
            "127.0.0.1.nip.io",
            "[::1]x",
            "[evil]:1",
            "localhost:port",
            "",
        ] {
            assert!(!is_local_host(host), "{host}");
        }
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        /// What a refusal may be: 400, 405, 431 or 505, a short body.
        fn refused_as_documented(response: &Response) -> Result<(), TestCaseError> {
            prop_assert!(
                [400, 405, 431, 505].contains(&response.status),
                "{}",
                response.status
            );
            prop_assert!(response.body.len() < 1024);
            prop_assert!(!reason(response.status).is_empty());
            Ok(())
        }

        /// A request accepted is what serve can act on: GET or HEAD, a
        /// path of the head's own bytes without controls or spaces, a
        /// Host without controls.
        fn accepted_is_sane(head: &[u8], request: &Request) -> Result<(), TestCaseError> {
            prop_assert!(request.path.starts_with('/'));
            prop_assert!(request.path.len() <= head.len());
            prop_assert!(!request.path.bytes().any(|b| b <= b' ' || b == 0x7f));
            prop_assert!(!request.path.contains(['?', '#']));
            if let Some(host) = &request.host {
                prop_assert!(host.len() <= head.len());
                prop_assert!(!host.bytes().any(|b| b < 0x20 && b != b'\t' || b == 0x7f));
                let _ = is_local_host(host);
            }
            Ok(())
        }

        /// Pieces of request heads, right and wrong.
        fn line_piece() -> impl Strategy<Value = Vec<u8>> {
            prop_oneof![
                3 => prop::sample::select(vec![
                    "GET", "HEAD", "POST", "get", "G(T", "", " ", "/", "/metrics", "/?a=b#c",
                    "http://localhost:1/x", "HTTP://x", "ftp://x/", "*", "HTTP/1.1", "HTTP/1.0",
                    "HTTP/2", "HTTP/", "Host: localhost", "Host: a", "Host:", "Host : a",
                    "Content-Length: 0", "Content-Length: 99999999999999999999",
                    "Transfer-Encoding: chunked", "X: \u{1}", " folded", "\t", "\r", "\r\n",
                    "\n", ":", "a:b",
                ]).prop_map(|p| p.as_bytes().to_vec()),
                1 => prop::collection::vec(any::<u8>(), 0..16),
                1 => "\\PC{0,16}".prop_map(String::into_bytes),
                1 => (1usize..10_000).prop_map(|n| vec![b'x'; n]),
            ]
        }

        fn head_of_pieces() -> impl Strategy<Value = Vec<u8>> {
            prop::collection::vec(
                (
                    line_piece(),
                    prop::sample::select(vec![&b" "[..], b"\r\n", b"\n", b""]),
                ),
                0..24,
            )
            .prop_map(|pieces| {
                let mut head: Vec<u8> = pieces
                    .into_iter()
                    .flat_map(|(piece, sep)| piece.into_iter().chain(sep.iter().copied()))
                    .collect();
                head.extend_from_slice(b"\r\n\r\n");
                head
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]

            /// Any bytes: no panic; refused as documented, or accepted
            /// and sane.
            #[test]
            fn any_head_is_refused_as_documented_or_sane(
                head in prop_oneof![
                    prop::collection::vec(any::<u8>(), 0..(MAX_HEAD + 64)),
                    head_of_pieces(),
                ],
            ) {
                match parse(&head) {
                    Ok(request) => accepted_is_sane(&head, &request)?,
                    Err(refusal) => refused_as_documented(&refusal)?,
                }
                if let Some(end) = head_end(&head) {
                    prop_assert!(end <= head.len());
                    prop_assert!(head[..end].ends_with(b"\n\n") || head[..end].ends_with(b"\r\n\r\n"));
                }
            }

            /// A well-formed GET or HEAD of any path and Host is read as
            /// it was sent, however many fields (within the limit) and
            /// whatever their values; one field too many is a 431.
            #[test]
            fn well_formed_requests_are_read_as_sent(
                head_method in any::<bool>(),
                path in "/[A-Za-z0-9._~/%-]{0,200}",
                query in prop::option::of("[A-Za-z0-9=&%]{0,50}"),
                host in "[a-z0-9.-]{1,60}(:[0-9]{1,5})?",
                fields in prop::collection::vec(("[A-Za-z0-9-]{1,20}", "[ -~]{0,100}"), 0..MAX_FIELDS),
                too_many in any::<bool>(),
            ) {
                let method = if head_method { "HEAD" } else { "GET" };
                let target = match &query {
                    Some(q) => format!("{path}?{q}"),
                    None => path.clone(),
                };
                let mut text = format!("{method} {target} HTTP/1.1\r\nHost: {host}\r\n");
                let fields: Vec<_> = fields
                    .into_iter()
                    .filter(|(name, _)| {
                        !["host", "content-length", "transfer-encoding"]
                            .contains(&name.to_ascii_lowercase().as_str())
                    })
                    .collect();
                let mut count = 1 + fields.len();
                for (name, value) in &fields {
                    text.push_str(&format!("{name}: {value}\r\n"));
                }
                while too_many && count <= MAX_FIELDS {
                    text.push_str("X-Pad: 1\r\n");
                    count += 1;
                }
                text.push_str("\r\n");
                match parse(text.as_bytes()) {
                    Ok(request) => {
                        prop_assert!(count <= MAX_FIELDS);
                        prop_assert_eq!(request.method, if head_method { Method::Head } else { Method::Get });
                        prop_assert_eq!(request.path, path);
                        prop_assert_eq!(request.host.as_deref(), Some(host.as_str()));
                    }
                    Err(refusal) => {
                        prop_assert!(count > MAX_FIELDS, "{}: {}", refusal.status, text);
                        prop_assert_eq!(refusal.status, 431);
                    }
                }
            }

            /// Any Host: no panic (it is compared, never resolved).
            #[test]
            fn any_host_is_judged_without_panic(host in "\\PC{0,300}") {
                let _ = is_local_host(&host);
            }
        }
    }

    #[test]
    fn dates_are_imf_fixdates() {
        use std::time::Duration;
        let at = |secs| SystemTime::UNIX_EPOCH + Duration::from_secs(secs);
        assert_eq!(http_date(at(0)), "Thu, 01 Jan 1970 00:00:00 GMT");
        assert_eq!(http_date(at(784_111_777)), "Sun, 06 Nov 1994 08:49:37 GMT");
        assert_eq!(
            http_date(at(1_709_208_000)),
            "Thu, 29 Feb 2024 12:00:00 GMT"
        );
    }
}
