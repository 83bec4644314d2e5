//! A compiled chat template in a minijinja environment configured like Hugging Face's Jinja2 one.

use minijinja::syntax::SyntaxConfig;
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Value};

use crate::error::{PreprocessError, Result};
use crate::py_json::tojson_filter;
use crate::strftime::strftime_now;
use crate::template_scan::rewrite_generation_tags;

const MAIN: &str = "chat";
const TOOL_USE: &str = "chat_tool_use";

/// The model's chat template(s), compiled once.
///
/// The environment mirrors `transformers`' `_compile_jinja_template`: `trim_blocks` and
/// `lstrip_blocks` on, loop controls, Python string/dict/list methods (minijinja-contrib
/// `pycompat`), `raise_exception`, `strftime_now` and a `tojson` that prints like Python's
/// `json.dumps`. No HTML escaping.
#[derive(Debug)]
pub(crate) struct ChatTemplate {
    env: Environment<'static>,
    has_tool_use: bool,
}

/// `raise_exception(message)`: aborts rendering with the template's message.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

fn compile_error(e: &Error) -> PreprocessError {
    PreprocessError::TemplateCompile(format!("{e:#}"))
}

impl ChatTemplate {
    /// Compiles the default template and, when given, the `tool_use` one.
    pub(crate) fn compile(main: &str, tool_use: Option<&str>) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| compile_error(&e))?;
        env.set_syntax(syntax);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson_filter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", |format: String| strftime_now(&format));
        for (name, source) in [(MAIN, Some(main)), (TOOL_USE, tool_use)] {
            let Some(source) = source else { continue };
            let source = rewrite_generation_tags(source).unwrap_or_else(|| source.to_owned());
            env.add_template_owned(name, source)
                .map_err(|e| compile_error(&e))?;
        }
        Ok(Self {
            env,
            has_tool_use: tool_use.is_some(),
        })
    }

    /// Renders with `context`; `with_tools` selects the `tool_use` template when the model has one.
    pub(crate) fn render(&self, context: &Value, with_tools: bool) -> Result<String> {
        let name = if with_tools && self.has_tool_use {
            TOOL_USE
        } else {
            MAIN
        };
        let template = self
            .env
            .get_template(name)
            .map_err(|e| PreprocessError::Template(e.to_string()))?;
        template.render(context).map_err(|e| {
            let message = match (e.kind(), e.detail()) {
                (ErrorKind::InvalidOperation, Some(detail)) => detail.to_owned(),
                _ => e.to_string(),
            };
            PreprocessError::Template(message)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use minijinja::context;

    fn render(src: &str, ctx: Value) -> Result<String> {
        ChatTemplate::compile(src, None)?.render(&ctx, false)
    }

    #[test]
    fn trims_blocks_like_transformers() {
        let src =
            "{% for m in messages %}\n    {% if m %}\n{{ m }}\n    {% endif %}\n{% endfor %}\n";
        assert_eq!(
            render(src, context!(messages => ["a", "b"])).unwrap(),
            "a\nb\n"
        );
    }

    #[test]
    fn python_methods_and_slices() {
        let src = "{{ s.split('</think>')[-1].lstrip('\\n') }}|{{ s.startswith('<') }}|{{ l[::-1] }}|\
                   {{ d.get('k', 'dflt') }}|{% set ns = namespace(n=0) %}{% set ns.n = 2 %}{{ ns.n }}|{{ none }}";
        let out = render(
            src,
            context!(s => "<think>x</think>\n\ny", l => [1, 2], d => context!()),
        )
        .unwrap();
        assert_eq!(out, "y|True|[2, 1]|dflt|2|None");
    }

    #[test]
    fn loop_controls() {
        let src = "{% for i in [1, 2, 3, 4] %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}";
        assert_eq!(render(src, context!()).unwrap(), "13");
    }

    #[test]
    fn tojson_is_python_flavoured_and_not_escaped() {
        let src = "{{ v | tojson }}|{{ v | tojson(indent=1) }}|{{ '<&>' }}";
        let v: Value = serde_json::from_str(r#"{"a": "<ü>", "b": [1.5]}"#).unwrap();
        assert_eq!(
            render(src, context!(v => v)).unwrap(),
            "{\"a\": \"<ü>\", \"b\": [1.5]}|{\n \"a\": \"<ü>\",\n \"b\": [\n  1.5\n ]\n}|<&>"
        );
    }

    #[test]
    fn raise_exception_carries_the_message() {
        let err = render(
            "{{ raise_exception('Only user and assistant roles!') }}",
            context!(),
        )
        .unwrap_err();
        assert!(err.is_client_error());
        assert_eq!(err.to_string(), "Only user and assistant roles!");
    }

    #[test]
    fn strftime_now_is_available() {
        let out = render("{{ strftime_now('%Y') }}", context!()).unwrap();
        assert_eq!(out.len(), 4, "{out}");
    }

    #[test]
    fn generation_tags_are_accepted() {
        let src = "{% for m in messages %}{% generation %}{{ m }}{% endgeneration %}{% endfor %}";
        assert_eq!(render(src, context!(messages => ["a"])).unwrap(), "a");
    }

    #[test]
    fn tool_use_template_is_picked_with_tools() {
        let t = ChatTemplate::compile("default", Some("tools")).unwrap();
        assert_eq!(t.render(&context!(), false).unwrap(), "default");
        assert_eq!(t.render(&context!(), true).unwrap(), "tools");
    }

    #[test]
    fn syntax_errors_fail_compilation() {
        let err = ChatTemplate::compile("{% if %}", None).unwrap_err();
        assert!(matches!(err, PreprocessError::TemplateCompile(_)), "{err}");
    }
}
