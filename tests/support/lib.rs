//! Support for Anneal's end-to-end tests: the `anneal` binary with its plugins ([`cli`]) and a
//! server on a random loopback port with a small HTTP client ([`serve`]); each family's tiny
//! model ([`tiny`]).

pub mod cli;
pub mod serve;
pub mod tiny;
