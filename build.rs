//! Links the unwinder statically on Linux with glibc, so the binary does not
//! load libgcc_s.so.1.
//!
//! Why: libgcc_s runs `__cpu_indicator_init` as a constructor in every process
//! that loads it, some thirty `cpuid` instructions, and under virtualisation
//! each `cpuid` traps to the hypervisor (about 5 µs apiece measured on this
//! project's CI kind of machine). That was the largest single cost devlock paid
//! per run beyond util-linux flock(1) (bench/RESULTS.md). Rust's std needs
//! only the `_Unwind_*` functions, which libgcc_eh.a (part of every gcc
//! install, found by the cc that links) provides; naming it here puts it
//! ahead of std's `-lgcc_s` on the link line, and `--as-needed` (rustc's
//! default) then drops libgcc_s. It is what `-C target-feature=+crt-static`
//! does for the unwinder, without linking glibc statically (which would
//! break user-name lookups through NSS and dlopen of GPU libraries).
//!
//! It also links the binary with packed relative relocations
//! (`-z pack-relative-relocs`, DT_RELR). Why: a position-independent Rust
//! binary carries one 24-byte RELA entry per pointer in its read-only data
//! (some 2,200 here, 53 kB), which the dynamic loader reads in every run; as
//! DT_RELR the same relocations take 640 bytes. The RELA table cost about a
//! tenth of an uncontended run's CPU (bench/RESULTS.md, "#22, fourth round"),
//! and it keeps the binary position-independent (ASLR), where `-no-pie` would
//! not. The linker (rust-lld, or GNU ld 2.38 and later) then makes the
//! binary require `GLIBC_ABI_DT_RELR`, which only glibc 2.36 and later
//! define, whatever glibc it links against: so it is asked for only when the
//! build is for this machine and its glibc (`getconf GNU_LIBC_VERSION`) is
//! 2.36 or later. A binary built on an older glibc, or for another machine,
//! goes without.
//!
//! And it lays out the code a waiting devlock and a plain take run side by
//! side, first in .text (`--symbol-ordering-file=bench/layout/order.txt`,
//! made by bench/layout/make). Why: a waiter's resident memory is mostly
//! the pages of the binary it touched, and the kernel maps 64 kB around
//! each page a process faults in, so code scattered over the 2.3 MB of
//! .text made most of it resident (section 5 of bench/run). Only the LLD
//! linker knows the option, and rustc links this target with its own LLD
//! from 1.90 on unless a linker is chosen: it is passed only then (or never
//! with `DEVLOCK_NO_LAYOUT=1`). The file names functions; one it no longer
//! finds is skipped without a word, so a stale file costs memory, never
//! the build. `DEVLOCK_LINK_MAP=FILE` writes the linker's map there (for
//! bench/layout/make).
//!
//! On the same LLD path it folds functions whose code is identical into one
//! (`--icf=all`). Why: generic code monomorphised for types of one layout
//! compiles to the same bytes many times over; folding them makes the
//! binary 73 kB (2.7%) smaller. `--icf=safe` folds nothing here (rustc
//! emits no address-significance tables). What it gives up is distinct
//! addresses for distinct functions, which Rust never promises and devlock
//! never compares.
//!
//! With the layout, the binary gets no DT_INIT (`-init` names a symbol that
//! does not exist). Why: glibc calls the program's `_init` at start, and
//! LLD puts that section (`.init`, from crti.o, which only calls
//! `__gmon_start__` when the program is built for gprof) after all of
//! .text, so one call of a do-nothing function made the last 64 kB of the
//! binary resident in every process, some 80 kB of a waiter's memory.
//! The constructors devlock has run from .init_array, as before.

fn main() {
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let env = std::env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
    let static_crt = std::env::var("CARGO_CFG_TARGET_FEATURE")
        .is_ok_and(|f| f.split(',').any(|f| f == "crt-static"));
    if os == "linux" && env == "gnu" && !static_crt {
        println!("cargo:rustc-link-lib=static:-bundle=gcc_eh");
        if glibc_reads_relr() {
            println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
        }
    }
    layout(&os, &env);
    println!("cargo:rerun-if-changed=build.rs");
}

/// The hot/cold layout and the link map (see the top of this file).
fn layout(os: &str, env: &str) {
    for var in [
        "DEVLOCK_LINK_MAP",
        "DEVLOCK_NO_LAYOUT",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS",
        "RUSTC_LINKER",
        "CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if let Some(map) = std::env::var_os("DEVLOCK_LINK_MAP") {
        println!(
            "cargo:rustc-link-arg-bins=-Wl,-Map={}",
            map.to_string_lossy()
        );
    }
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default();
    let order = std::path::Path::new(&manifest).join("bench/layout/order.txt");
    println!("cargo:rerun-if-changed={}", order.display());
    if os != "linux" || env != "gnu" || std::env::var_os("DEVLOCK_NO_LAYOUT").is_some() {
        return;
    }
    if !order.is_file() || !links_with_rust_lld() {
        return;
    }
    println!(
        "cargo:rustc-link-arg-bins=-Wl,--symbol-ordering-file={}",
        order.display()
    );
    println!("cargo:rustc-link-arg-bins=-Wl,--no-warn-symbol-ordering");
    println!("cargo:rustc-link-arg-bins=-Wl,-init=devlock_no_dt_init");
    println!("cargo:rustc-link-arg-bins=-Wl,--icf=all");
}

/// Whether rustc links the binary with its own LLD: x86_64 Linux with glibc,
/// rustc 1.90 or later, and no linker chosen in the environment (a
/// `-C linker` or `linker-flavor` in the flags, a target's linker).
fn links_with_rust_lld() -> bool {
    if std::env::var("TARGET").ok().as_deref() != Some("x86_64-unknown-linux-gnu") {
        return false;
    }
    let flags = [
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS",
    ]
    .iter()
    .filter_map(|v| std::env::var(v).ok())
    .collect::<String>();
    if ["linker", "link-self-contained", "fuse-ld"]
        .iter()
        .any(|f| flags.contains(f))
        || std::env::var_os("RUSTC_LINKER").is_some()
        || std::env::var_os("CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER").is_some()
    {
        return false;
    }
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let Ok(out) = std::process::Command::new(rustc).arg("-vV").output() else {
        return false;
    };
    // "release: 1.95.0"
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(release) = text.lines().find_map(|l| l.strip_prefix("release: ")) else {
        return false;
    };
    let mut version = release.split(['.', '-']);
    let number = |part: Option<&str>| part.and_then(|p| p.parse::<u32>().ok());
    matches!(
        (number(version.next()), number(version.next())),
        (Some(major), Some(minor)) if (major, minor) >= (1, 90)
    )
}

/// Whether the glibc the binary will run on reads DT_RELR (2.36 and later):
/// asked of this machine's `getconf` when the build is for this machine.
fn glibc_reads_relr() -> bool {
    if std::env::var("HOST").ok() != std::env::var("TARGET").ok() {
        return false;
    }
    let Ok(out) = std::process::Command::new("getconf")
        .arg("GNU_LIBC_VERSION")
        .output()
    else {
        return false;
    };
    // "glibc 2.36"
    let text = String::from_utf8_lossy(&out.stdout);
    let mut version = text.trim().trim_start_matches("glibc ").split('.');
    let number = |part: Option<&str>| part.and_then(|p| p.parse::<u32>().ok());
    matches!(
        (number(version.next()), number(version.next())),
        (Some(major), Some(minor)) if (major, minor) >= (2, 36)
    )
}
