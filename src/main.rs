//! The `floe` executable, with the built-in UDFs.

fn main() -> std::process::ExitCode {
    floe::run(floe::Registry::with_builtins())
}
