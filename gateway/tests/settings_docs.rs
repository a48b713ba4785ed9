//! docs/settings.md and packaging/autopush.toml are generated from the
//! settings' declarations (`autopush_gateway::reference`): these tests fail
//! when a checked-in file differs from what the code makes. After changing
//! a setting, regenerate both with
//!
//!     UPDATE_DOCS=1 cargo test -p autopush-gateway --test settings_docs

use std::path::PathBuf;

use autopush_gateway::settings::{Settings, SettingsLayer, settings_args};
use autopush_gateway::{reference, secrets};

fn repo_file(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
}

/// The file at `path` is `generated`, or (with UPDATE_DOCS=1) is made so.
fn up_to_date(path: &str, generated: &str) {
    let file = repo_file(path);
    if std::env::var_os("UPDATE_DOCS").is_some() {
        std::fs::create_dir_all(file.parent().expect("a parent")).expect("make the directory");
        std::fs::write(&file, generated).expect("write the generated file");
        return;
    }
    let checked_in = std::fs::read_to_string(&file).unwrap_or_default();
    assert!(
        checked_in == generated,
        "{path} differs from what the code generates; regenerate it with\n  \
         UPDATE_DOCS=1 cargo test -p autopush-gateway --test settings_docs"
    );
}

#[test]
fn the_settings_reference_is_generated_from_the_code() {
    let markdown = reference::markdown();
    for arg in settings_args() {
        let row = format!("| `{}` | `--{}` |", arg.get_id(), arg.get_long().unwrap());
        assert!(markdown.contains(&row), "no row {row}");
    }
    up_to_date("docs/settings.md", &markdown);
}

#[test]
fn the_example_config_is_generated_from_the_code() {
    let example = reference::example_toml();
    for arg in settings_args() {
        let key = arg.get_id().as_str();
        let long = arg.get_long().unwrap().replace('-', "_");
        // A secret has no line of its own: its `_file` form has.
        let line = match key {
            "db" => format!("db = \"{}\"", reference::PACKAGED_DB),
            _ if secrets::SECRETS.contains(&long.as_str()) => format!("# {long}_file = "),
            _ => format!("# {key} = "),
        };
        assert!(
            example.lines().any(|l| l.starts_with(&line)),
            "no line {line:?} for {key}"
        );
    }
    up_to_date("packaging/autopush.toml", &example);
}

/// The commented settings of the example, each uncommented: `key = value`.
fn commented_settings(example: &str) -> Vec<String> {
    example
        .lines()
        .filter_map(|l| l.strip_prefix("# "))
        .filter(|l| {
            l.split_once(" = ")
                .is_some_and(|(key, _)| !key.contains(' '))
        })
        .map(str::to_owned)
        .collect()
}

/// The example parses as it is and sets the data directory only; with
/// every setting that has a default uncommented it gives exactly the
/// defaults: its values are the defaults.
#[test]
fn the_example_config_parses_and_holds_the_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let packaged = SettingsLayer {
        db: Some(reference::PACKAGED_DB.into()),
        ..SettingsLayer::default()
    };
    let defaults = packaged.with_defaults().lines(true).unwrap();
    let example = reference::example_toml();
    let as_is = dir.path().join("as-is.toml");
    std::fs::write(&as_is, &example).unwrap();
    let layer = SettingsLayer::merged(SettingsLayer::default(), Some(&as_is)).unwrap();
    assert_eq!(layer.with_defaults().lines(true).unwrap(), defaults);

    let default_lines = SettingsLayer::default()
        .with_defaults()
        .lines(true)
        .unwrap();
    let uncommented: String = commented_settings(&example)
        .into_iter()
        .filter(|l| default_lines.contains(l))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(uncommented.contains("port = 8080\n"), "{uncommented}");
    let path = dir.path().join("uncommented.toml");
    std::fs::write(&path, &uncommented).unwrap();
    let layer = SettingsLayer::merged(SettingsLayer::default(), Some(&path))
        .unwrap_or_else(|e| panic!("{e}\n{uncommented}"));
    assert_eq!(
        layer.clone().with_defaults().lines(true).unwrap(),
        default_lines
    );
    Settings::from_layer(layer).unwrap();
}

/// Every commented setting in the example has a value, and uncommented
/// on its own it is read: no `key =` without a value, no value of the
/// wrong type.
#[test]
fn every_commented_setting_in_the_example_is_valid_uncommented() {
    let dir = tempfile::tempdir().unwrap();
    let example = reference::example_toml();
    let bare: Vec<&str> = example.lines().filter(|l| l.ends_with(" =")).collect();
    assert!(bare.is_empty(), "settings without a value: {bare:?}");
    let settings = commented_settings(&example);
    assert!(settings.len() > 50, "{settings:?}");
    for line in settings {
        let path = dir.path().join("one.toml");
        std::fs::write(&path, format!("{line}\n")).unwrap();
        SettingsLayer::merged(SettingsLayer::default(), Some(&path))
            .unwrap_or_else(|e| panic!("{line}: {e}"));
    }
}
