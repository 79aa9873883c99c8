//! Who holds each lock and who waits: the model ([`model`], from the kernel
//! first and the records as labels) apart from its renderings ([`table`]).

pub(crate) mod model;
pub(crate) mod print;
pub(crate) mod requests;
pub(crate) mod table;
