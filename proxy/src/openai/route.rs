//! The data listener's routes.

use http::Method;
use kvmesh_route::prepare::PromptKind;

/// An OpenAI API endpoint the proxy serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// `POST /v1/chat/completions`
    ChatCompletions,
    /// `POST /v1/completions`
    Completions,
    /// `POST /v1/embeddings`
    Embeddings,
    /// `POST /v1/responses`
    Responses,
    /// `GET /v1/models`
    Models,
    /// `GET /openapi.json`: the OpenAPI description of these routes.
    OpenApi,
    /// `GET /docs`: an HTML page rendering it.
    Docs,
}

/// Number of [`Route`]s (for per-route metric handles).
pub(crate) const ROUTE_COUNT: usize = 7;

impl Route {
    /// What kind of prompt a body sent to this route carries (what routing reads).
    pub(crate) fn prompt_kind(self) -> PromptKind {
        match self {
            Route::ChatCompletions => PromptKind::Chat,
            Route::Completions => PromptKind::Completion,
            Route::Embeddings | Route::Responses | Route::Models | Route::OpenApi | Route::Docs => {
                PromptKind::Other
            }
        }
    }

    /// Every route, in [`Route::index`] order.
    pub(crate) const ALL: [Route; ROUTE_COUNT] = [
        Route::ChatCompletions,
        Route::Completions,
        Route::Embeddings,
        Route::Responses,
        Route::Models,
        Route::OpenApi,
        Route::Docs,
    ];

    /// Position in [`Route::ALL`].
    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// Label used in metrics and logs.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::ChatCompletions => "chat_completions",
            Self::Completions => "completions",
            Self::Embeddings => "embeddings",
            Self::Responses => "responses",
            Self::Models => "models",
            Self::OpenApi => "openapi",
            Self::Docs => "docs",
        }
    }

    /// Whether requests on this route are forwarded to a model's backend.
    pub(crate) fn is_proxied(self) -> bool {
        !matches!(self, Self::Models | Self::OpenApi | Self::Docs)
    }
}

/// The result of matching a request line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RouteMatch {
    /// A served route.
    Found(Route),
    /// The path exists but not for this method; the value is the `Allow` header.
    MethodNotAllowed(&'static str),
    /// No such path.
    NotFound,
}

/// Matches a method and path (without query).
pub(crate) fn match_route(method: &Method, path: &str) -> RouteMatch {
    let (route, allowed, allow) = match path {
        "/v1/chat/completions" => (Route::ChatCompletions, Method::POST, "POST"),
        "/v1/completions" => (Route::Completions, Method::POST, "POST"),
        "/v1/embeddings" => (Route::Embeddings, Method::POST, "POST"),
        "/v1/responses" => (Route::Responses, Method::POST, "POST"),
        "/v1/models" => (Route::Models, Method::GET, "GET"),
        "/openapi.json" => (Route::OpenApi, Method::GET, "GET"),
        "/docs" => (Route::Docs, Method::GET, "GET"),
        _ => return RouteMatch::NotFound,
    };
    if *method == allowed {
        RouteMatch::Found(route)
    } else {
        RouteMatch::MethodNotAllowed(allow)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_paths_and_methods() {
        assert_eq!(
            match_route(&Method::POST, "/v1/chat/completions"),
            RouteMatch::Found(Route::ChatCompletions)
        );
        assert_eq!(
            match_route(&Method::POST, "/v1/embeddings"),
            RouteMatch::Found(Route::Embeddings)
        );
        assert_eq!(
            match_route(&Method::GET, "/v1/models"),
            RouteMatch::Found(Route::Models)
        );
        assert_eq!(
            match_route(&Method::GET, "/v1/completions"),
            RouteMatch::MethodNotAllowed("POST")
        );
        assert_eq!(
            match_route(&Method::POST, "/v1/models"),
            RouteMatch::MethodNotAllowed("GET")
        );
        assert_eq!(match_route(&Method::GET, "/v2/x"), RouteMatch::NotFound);
        assert_eq!(
            match_route(&Method::POST, "/v1/chat/completions/"),
            RouteMatch::NotFound
        );
    }

    #[test]
    fn indices_follow_all() {
        for (i, route) in Route::ALL.iter().enumerate() {
            assert_eq!(route.index(), i);
        }
        assert!(!Route::Models.is_proxied());
        assert!(!Route::OpenApi.is_proxied());
        assert!(!Route::Docs.is_proxied());
        assert!(Route::Responses.is_proxied());
    }
}
