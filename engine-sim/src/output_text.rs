//! A sequence's generated text, stop-string matching and what may be streamed so far.

use std::sync::Arc;

/// Result of appending one generated word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Appended {
    /// No stop string matched.
    Continue,
    /// Stop string number `.0` matched; the text was cut where it starts.
    Stopped(usize),
}

/// Generated text with vLLM's stop rule: a stop string ends generation and is cut from the
/// output, and while stop strings are set the last `longest stop - 1` bytes are held back from
/// streaming so a partial stop string is never sent.
#[derive(Debug)]
pub(crate) struct OutputText {
    text: String,
    emitted: usize,
    stops: Arc<[String]>,
    hold_back: usize,
}

impl OutputText {
    /// Empty text with the request's stop strings (empty strings must already be filtered out).
    pub(crate) fn new(stops: Arc<[String]>) -> Self {
        let hold_back = stops
            .iter()
            .map(|s| s.len())
            .max()
            .unwrap_or(1)
            .saturating_sub(1);
        Self {
            text: String::new(),
            emitted: 0,
            stops,
            hold_back,
        }
    }

    /// Appends one generated word (space-separated from the previous one) and checks the stops.
    pub(crate) fn push_word(&mut self, word: &str) -> Appended {
        let old_len = self.text.len();
        if !self.text.is_empty() {
            self.text.push(' ');
        }
        self.text.push_str(word);
        let mut earliest: Option<(usize, usize)> = None;
        for (i, stop) in self.stops.iter().enumerate() {
            // Only a match that ends in the new text can be new.
            let from = floor_boundary(
                &self.text,
                old_len.saturating_sub(stop.len().saturating_sub(1)),
            );
            if let Some(pos) = self.text[from..].find(stop.as_str()) {
                let pos = from + pos;
                if earliest.is_none_or(|(p, _)| pos < p) {
                    earliest = Some((pos, i));
                }
            }
        }
        match earliest {
            Some((pos, i)) => {
                self.text.truncate(pos);
                Appended::Stopped(i)
            }
            None => Appended::Continue,
        }
    }

    /// Text not streamed yet that is safe to stream; with `finished` everything left.
    pub(crate) fn take_delta(&mut self, finished: bool) -> String {
        let end = if finished {
            self.text.len()
        } else {
            floor_boundary(&self.text, self.text.len().saturating_sub(self.hold_back))
        };
        if end <= self.emitted {
            return String::new();
        }
        let delta = self.text[self.emitted..end].to_owned();
        self.emitted = end;
        delta
    }

    /// Takes the whole text (non-streaming results), leaving it empty.
    pub(crate) fn take_text(&mut self) -> String {
        self.emitted = 0;
        std::mem::take(&mut self.text)
    }

    /// The stop strings of this request.
    pub(crate) fn stops(&self) -> &[String] {
        &self.stops
    }
}

fn floor_boundary(s: &str, mut index: usize) -> usize {
    index = index.min(s.len());
    while !s.is_char_boundary(index) {
        index -= 1;
    }
    index
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(list: &[&str]) -> Arc<[String]> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn without_stops_everything_streams() {
        let mut t = OutputText::new(stops(&[]));
        assert_eq!(t.push_word("alpha"), Appended::Continue);
        assert_eq!(t.take_delta(false), "alpha");
        t.push_word("beta");
        assert_eq!(t.take_delta(false), " beta");
        assert_eq!(t.take_delta(true), "");
        assert_eq!(t.take_text(), "alpha beta");
    }

    #[test]
    fn stop_truncates_and_is_never_streamed() {
        let mut t = OutputText::new(stops(&["a be"]));
        t.push_word("alpha");
        let first = t.take_delta(false);
        assert_eq!(first, "al");
        assert_eq!(t.push_word("beta"), Appended::Stopped(0));
        let rest = t.take_delta(true);
        assert_eq!(format!("{first}{rest}"), "alph");
        assert_eq!(t.take_text(), "alph");
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let mut t = OutputText::new(stops(&["gamma", "beta"]));
        t.push_word("alpha");
        assert_eq!(t.push_word("beta"), Appended::Stopped(1));
        assert_eq!(t.take_text(), "alpha ");
    }
}
