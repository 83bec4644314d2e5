//! Paths to config fields, written like `models[0].backends[1].url`.

use std::fmt;

/// One step of a [`FieldPath`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// A mapping key.
    Key(String),
    /// A sequence index.
    Index(usize),
}

/// The location of a field in the config tree, independent of the YAML text.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FieldPath {
    segments: Vec<Segment>,
}

impl FieldPath {
    /// The root of the document.
    pub fn root() -> Self {
        Self::default()
    }

    /// This path extended by a mapping key.
    pub fn key(&self, key: &str) -> Self {
        let mut segments = self.segments.clone();
        segments.push(Segment::Key(key.to_string()));
        Self { segments }
    }

    /// This path extended by a sequence index.
    pub fn index(&self, index: usize) -> Self {
        let mut segments = self.segments.clone();
        segments.push(Segment::Index(index));
        Self { segments }
    }

    /// The steps from the root.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Whether this is the document root.
    pub fn is_root(&self) -> bool {
        self.segments.is_empty()
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, segment) in self.segments.iter().enumerate() {
            match segment {
                Segment::Key(key) if i == 0 => f.write_str(key)?,
                Segment::Key(key) => write!(f, ".{key}")?,
                Segment::Index(index) => write!(f, "[{index}]")?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn displays_keys_and_indices() {
        let path = FieldPath::root()
            .key("models")
            .index(0)
            .key("backends")
            .index(1)
            .key("url");
        assert_eq!(path.to_string(), "models[0].backends[1].url");
        assert_eq!(FieldPath::root().to_string(), "");
        assert!(FieldPath::root().is_root());
        assert_eq!(path.segments().len(), 5);
    }
}
