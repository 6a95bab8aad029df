//! `train --run-config FILE.toml`: a TOML file whose keys are `train`'s
//! flag names (kebab-case as on the command line, `n-layer`, or snake_case,
//! `n_layer`), with values of the flag's type: strings, numbers, and
//! `true`/`false` for switches (`zero1 = true`). A flag given on the command
//! line overrides the file: the file's keys become flags placed before the
//! command line's, and only for the flags the command line did not set
//! (told apart by clap's `ValueSource`).
//!
//! The flag is `--run-config`, not `--config`, because `--config` already
//! names a model's Hugging Face `config.json`.
//!
//! **Invariant:** every key is checked against the flags (an unknown key is
//! an error listing the accepted ones) and every value by the flag's own
//! parser, before the command line is parsed again.

use std::ffi::{OsStr, OsString};
use std::path::Path;

use anyhow::{bail, Context, Result};
use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Command};

/// Flags that cannot come from the file: this one, and the launcher's own.
const NOT_IN_FILE: [&str; 4] = ["help", "run_config", "rank", "nccl_id"];

/// The flags `train_cmd` (the `train` subcommand) accepts in a file, as
/// written there (kebab-case).
pub fn accepted_keys(train_cmd: &Command) -> Vec<String> {
    train_cmd
        .get_arguments()
        .filter(|a| !NOT_IN_FILE.contains(&a.get_id().as_str()) && !a.is_hide_set())
        .filter_map(|a| a.get_long().map(str::to_string))
        .collect()
}

/// The command-line arguments that `file` adds to `train`'s: one flag per
/// key whose flag the command line (parsed as `given`) did not set.
pub fn file_args(train_cmd: &Command, file: &Path, given: &ArgMatches) -> Result<Vec<OsString>> {
    let text = std::fs::read_to_string(file).with_context(|| format!("reading the run config {}", file.display()))?;
    let table: toml::Table =
        text.parse().with_context(|| format!("{} is not valid TOML (the run config)", file.display()))?;
    let accepted = accepted_keys(train_cmd);
    let mut args = Vec::new();
    for (key, value) in &table {
        let long = key.replace('_', "-");
        let arg = train_cmd
            .get_arguments()
            .find(|a| a.get_long() == Some(long.as_str()) && accepted.contains(&long))
            .with_context(|| {
            format!("{}: unknown key `{key}`; the accepted keys are {}", file.display(), accepted.join(", "))
        })?;
        if given.value_source(arg.get_id().as_str()) == Some(ValueSource::CommandLine) {
            continue;
        }
        let switch = matches!(arg.get_action(), ArgAction::SetTrue);
        let flag = OsString::from(format!("--{long}"));
        match value {
            toml::Value::Boolean(on) if switch => {
                if *on {
                    args.push(flag);
                }
            }
            _ if switch => {
                bail!("{}: `{key}` is a switch: write `{key} = true` or `false`, not {value}", file.display())
            }
            toml::Value::String(_) | toml::Value::Integer(_) | toml::Value::Float(_) => {
                let text = match value {
                    toml::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                // The flag's own parser, alone in a command (its relations
                // to other flags are checked when the command line is parsed again).
                let id = arg.get_id().clone();
                let alone = Arg::new(id.clone()).allow_hyphen_values(true).value_parser(arg.get_value_parser().clone());
                let parsed =
                    Command::new("train").arg(alone).try_get_matches_from([OsStr::new("train"), OsStr::new(&text)]);
                if let Err(e) = parsed {
                    let why: Vec<String> = e
                        .to_string()
                        .lines()
                        .map(|l| {
                            l.trim().trim_start_matches("error: ").replace(&format!("'<{id}>'"), &format!("--{long}"))
                        })
                        .filter(|l| !l.is_empty() && !l.starts_with("For more information"))
                        .collect();
                    bail!("{}: `{key}` = {value} is not accepted: {}", file.display(), why.join(" "));
                }
                args.push(flag);
                args.push(text.into());
            }
            other => bail!(
                "{}: `{key}` = {other} is a TOML {}; `{key}` takes a string or a number",
                file.display(),
                other.type_str()
            ),
        }
    }
    Ok(args)
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    fn train_cmd() -> Command {
        let mut cmd = crate::Cli::command();
        cmd.build();
        cmd.find_subcommand("train").unwrap().clone()
    }

    fn with_file(toml: &str, cli: &[&str]) -> Result<Vec<String>> {
        let dir = std::env::temp_dir().join(format!("stepgraph-run-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join(format!("{:x}.toml", toml.len() * 31 + cli.len()));
        std::fs::write(&file, toml).unwrap();
        let cmd = train_cmd();
        let given = cmd.clone().try_get_matches_from(std::iter::once("train").chain(cli.iter().copied())).unwrap();
        let out = file_args(&cmd, &file, &given);
        let _ = std::fs::remove_file(&file);
        out.map(|a| a.into_iter().map(|s| s.into_string().unwrap()).collect())
    }

    #[test]
    fn keys_become_flags_unless_the_command_line_sets_them() {
        let a = with_file("steps = 30\nn_layer = 2\nlr = 0.001\nzero1 = false\ndata = \"x.txt\"\n", &["--steps", "5"])
            .unwrap();
        assert_eq!(a, ["--data", "x.txt", "--lr", "0.001", "--n-layer", "2"]);
        // Kebab-case keys and switches.
        let a = with_file("fail-on-divergence = true\n", &[]).unwrap();
        assert_eq!(a, ["--fail-on-divergence"]);
        // A flag at its default value on the command line is not "given".
        let a = with_file("seed = 7\n", &["--steps", "2"]).unwrap();
        assert_eq!(a, ["--seed", "7"]);
    }

    #[test]
    fn bad_keys_and_values_name_the_file_key_and_value() {
        let e = with_file("stepz = 3\n", &[]).unwrap_err().to_string();
        assert!(e.contains(".toml: unknown key `stepz`") && e.contains("steps, lr"), "{e}");
        let e = with_file("steps = \"many\"\n", &[]).unwrap_err().to_string();
        assert!(e.contains("`steps` = \"many\" is not accepted") && e.contains("invalid digit"), "{e}");
        let e = with_file("dtype = \"f8\"\n", &[]).unwrap_err().to_string();
        assert!(e.contains("`dtype` = \"f8\"") && e.contains("bf16"), "{e}");
        let e = with_file("zero1 = 1\n", &[]).unwrap_err().to_string();
        assert!(e.contains("`zero1` is a switch"), "{e}");
        let e = with_file("steps = [1, 2]\n", &[]).unwrap_err().to_string();
        assert!(e.contains("`steps` = [1, 2] is a TOML array"), "{e}");
        let e = with_file("rank = 1\n", &[]).unwrap_err().to_string();
        assert!(e.contains("unknown key `rank`"), "{e}");
        let e = with_file("steps = \n", &[]).unwrap_err().to_string();
        assert!(e.contains("is not valid TOML"), "{e}");
    }
}
