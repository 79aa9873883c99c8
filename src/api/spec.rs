//! The library's input: the command line's options as a [`Spec`], planned
//! by the command line's rules ([`crate::plan::Plan::from_spec`]), and
//! durations read as the command line reads them.

// Spec lives with the plan it is read into (the core); the library's path
// to it stays this one.

/// A duration as the command line reads one (`90`, `1.5`, `90s`, `10m`,
/// `1h30m`), for the library's option `name` (`timeout`, `settle`): what a
/// binding does with a string it is given. A text that is none is a usage
/// error in the library's words.
pub fn duration_of(name: &str, text: &str) -> crate::Result<std::time::Duration> {
    crate::units::parse_duration(text)
        .map_err(|_| crate::Error::Usage(crate::messages::library_duration(name, text)))
}
