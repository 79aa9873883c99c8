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

fn main() {
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let env = std::env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
    let static_crt = std::env::var("CARGO_CFG_TARGET_FEATURE")
        .is_ok_and(|f| f.split(',').any(|f| f == "crt-static"));
    if os == "linux" && env == "gnu" && !static_crt {
        println!("cargo:rustc-link-lib=static:-bundle=gcc_eh");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
