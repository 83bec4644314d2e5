//! Fuzz-style tests of the config loader (proptest): any text, and the example
//! config with any line dropped, duplicated or garbled, is accepted or
//! rejected with an error, never a panic.

use kvmesh_config::{Config, ConfigError};
use proptest::prelude::*;

const EXAMPLE: &str = include_str!("../../config/examples/kvmesh.yaml");

fn load(text: &str) {
    match Config::from_yaml_str(text, "fuzz.yaml") {
        Ok(config) => {
            // What parsed also validates the same way when built in code.
            assert!(config.validate().is_ok());
        }
        Err(ConfigError::Invalid(invalid)) => {
            assert!(invalid.to_string().starts_with("fuzz.yaml"));
        }
        Err(other) => panic!("unexpected error kind: {other}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_text_never_panics(text in "\\PC{0,400}") {
        load(&text);
    }

    #[test]
    fn yaml_shaped_text_never_panics(
        lines in proptest::collection::vec("( {0,6})([a-z_]{1,12})(: ?)([-\\[\\]{}a-z0-9_:.,/ ]{0,16})", 0..24),
    ) {
        load(&lines.join("\n"));
    }

    #[test]
    fn a_mutated_example_never_panics(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), 0u8..4, "\\PC{0,12}"), 1..6),
    ) {
        let mut lines: Vec<String> = EXAMPLE.lines().map(str::to_string).collect();
        for (at, kind, text) in edits {
            let i = at.index(lines.len());
            match kind {
                0 => {
                    lines.remove(i);
                }
                1 => {
                    let line = lines[i].clone();
                    lines.insert(i, line);
                }
                2 => {
                    let half = lines[i].chars().count() / 2;
                    lines[i] = lines[i].chars().take(half).collect::<String>() + &text;
                }
                _ => lines.insert(i, text),
            }
            if lines.is_empty() {
                break;
            }
        }
        load(&lines.join("\n"));
    }
}
