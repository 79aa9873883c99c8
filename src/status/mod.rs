//! Who holds each lock and who waits: the model ([`model`], from the kernel
//! first and the records as labels) apart from its renderings ([`table`]).

pub(crate) mod notes;
pub(crate) mod print;
pub(crate) mod table;

// The model moved to the core's `view`; the old paths stay for the front
// ends until the crate split rewrites them.
