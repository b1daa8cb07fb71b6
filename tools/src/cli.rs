//! What every kvrail tool's command line shares: `--version` naming the build, and
//! `--generate man|bash|zsh|fish|elvish|powershell`, a man page or shell completions made
//! from the tool's own clap definition (so they never drift from `--help`).

use std::io::Write;

/// `VERSION (commit ...)`: the crate's version and the commit the binary was built from.
pub(crate) const VERSION: &str =
    concat!(env!("CARGO_PKG_VERSION"), " (", env!("KVRAIL_BUILD"), ")");

/// When the command line is `--generate WHAT`, writes the man page (`man`) or the
/// completion script for shell `WHAT` of `cmd` to standard output and returns the exit
/// status to end with; None for any other command line.
pub(crate) fn generate_if_asked(cmd: clap::Command) -> Option<std::process::ExitCode> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) != Some("--generate") {
        return None;
    }
    let name = cmd.get_name().to_owned();
    let mut out = Vec::new();
    let r = match args.get(1).map(String::as_str) {
        Some("man") if args.len() == 2 => clap_mangen::Man::new(cmd)
            .render(&mut out)
            .map_err(|e| e.to_string()),
        Some(shell) if args.len() == 2 => match shell.parse::<clap_complete::Shell>() {
            Ok(sh) => {
                clap_complete::generate(sh, &mut cmd.clone(), name.clone(), &mut out);
                Ok(())
            }
            Err(_) => Err(format!(
                "--generate: {shell:?} is not man, bash, zsh, fish, elvish or powershell"
            )),
        },
        _ => Err("usage: --generate man|bash|zsh|fish|elvish|powershell".to_owned()),
    };
    Some(
        match r.and_then(|()| std::io::stdout().write_all(&out).map_err(|e| e.to_string())) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("{name}: {e}");
                std::process::ExitCode::from(2)
            }
        },
    )
}
