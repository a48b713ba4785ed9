#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| autopush_gateway::fuzzing::push_headers(data));
