//! The data listener's routes: the OpenAI routes kvmesh interprets, and the engines' own
//! routes it forwards as they are (`engine_routes`, [`EngineRoutes`]).

use std::collections::HashSet;

use http::Method;
use kvmesh_config::{ENGINE_ROUTES, EngineAccess, EngineRoutesConfig};
use kvmesh_route::prepare::PromptKind;

/// An endpoint the data listener serves.
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
    /// An engine's own route, forwarded as it is.
    Engine(EngineRoute),
}

/// An engine route: one of [`ENGINE_ROUTES`], or a path `engine_routes.forward` adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct EngineRoute(u8);

/// The [`EngineRoute`] of paths `engine_routes.forward` names beyond [`ENGINE_ROUTES`].
const CONFIGURED: u8 = ENGINE_ROUTES.len() as u8;

/// Routes kvmesh serves itself (before the engine routes in [`Route::ALL`]).
const OWN_ROUTES: usize = 7;

/// Number of [`Route`]s (for per-route metric handles).
pub(crate) const ROUTE_COUNT: usize = OWN_ROUTES + ENGINE_ROUTES.len() + 1;

impl EngineRoute {
    /// Whether only API keys with `engine_admin` may use it.
    pub(crate) fn is_admin(self) -> bool {
        ENGINE_ROUTES
            .get(usize::from(self.0))
            .is_some_and(|spec| spec.access == EngineAccess::Admin)
    }

    /// Whether it generates from a prompt as chat and completions do (SGLang's native
    /// `/generate`): a disaggregated model runs it in two legs.
    pub(crate) fn generates(self) -> bool {
        ENGINE_ROUTES
            .get(usize::from(self.0))
            .is_some_and(|spec| spec.path == "/generate")
    }

    /// The prompt its body carries, which `policy: kv` routes by.
    pub(crate) fn prompt_kind(self) -> PromptKind {
        match ENGINE_ROUTES.get(usize::from(self.0)).map(|spec| spec.path) {
            Some("/tokenize") => PromptKind::Tokenize,
            Some("/inference/v1/generate") => PromptKind::TokenIds,
            _ => PromptKind::Other,
        }
    }

    /// Label in metrics and logs: its path (`other` for a configured path beyond the table).
    fn label(self) -> &'static str {
        ENGINE_ROUTES
            .get(usize::from(self.0))
            .map_or("other", |spec| spec.path)
    }
}

impl Route {
    /// What kind of prompt a body sent to this route carries (what routing reads).
    pub(crate) fn prompt_kind(self) -> PromptKind {
        match self {
            Route::ChatCompletions => PromptKind::Chat,
            Route::Completions => PromptKind::Completion,
            Route::Responses => PromptKind::Responses,
            Route::Engine(route) => route.prompt_kind(),
            Route::Embeddings | Route::Models | Route::OpenApi | Route::Docs => PromptKind::Other,
        }
    }

    /// Every route, in [`Route::index`] order.
    pub(crate) const ALL: [Route; ROUTE_COUNT] = {
        let mut all = [Route::ChatCompletions; ROUTE_COUNT];
        all[1] = Route::Completions;
        all[2] = Route::Embeddings;
        all[3] = Route::Responses;
        all[4] = Route::Models;
        all[5] = Route::OpenApi;
        all[6] = Route::Docs;
        let mut engine = 0;
        while engine <= ENGINE_ROUTES.len() {
            all[OWN_ROUTES + engine] = Route::Engine(EngineRoute(engine as u8));
            engine += 1;
        }
        all
    };

    /// Position in [`Route::ALL`].
    pub(crate) fn index(self) -> usize {
        match self {
            Self::ChatCompletions => 0,
            Self::Completions => 1,
            Self::Embeddings => 2,
            Self::Responses => 3,
            Self::Models => 4,
            Self::OpenApi => 5,
            Self::Docs => 6,
            Self::Engine(route) => OWN_ROUTES + usize::from(route.0),
        }
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
            Self::Engine(route) => route.label(),
        }
    }

    /// Whether requests on this route are forwarded to a model's backend.
    pub(crate) fn is_proxied(self) -> bool {
        !matches!(self, Self::Models | Self::OpenApi | Self::Docs)
    }
}

/// The engine routes the data listener forwards (`engine_routes` of the config).
#[derive(Debug, Clone)]
pub(crate) struct EngineRoutes {
    /// Per [`ENGINE_ROUTES`] entry: forwarded (admin routes always are, for keys allowed).
    table: [bool; ENGINE_ROUTES.len()],
    /// Paths beyond the table.
    configured: HashSet<Box<str>>,
}

impl Default for EngineRoutes {
    /// Forwards no engine route at all.
    fn default() -> Self {
        Self {
            table: [false; ENGINE_ROUTES.len()],
            configured: HashSet::new(),
        }
    }
}

impl EngineRoutes {
    /// The routes `config` forwards, with every admin route of the table.
    pub(crate) fn new(config: &EngineRoutesConfig) -> Self {
        let mut routes = Self::default();
        for (at, spec) in ENGINE_ROUTES.iter().enumerate() {
            routes.table[at] = spec.access == EngineAccess::Admin;
        }
        for path in &config.forward {
            match ENGINE_ROUTES.iter().position(|spec| spec.path == path) {
                Some(at) => routes.table[at] = true,
                None => {
                    routes.configured.insert(path.as_str().into());
                }
            }
        }
        routes
    }

    /// The engine route at `path`, when forwarded: `Ok(route)` for `method`, `Err(allow)`
    /// when it takes another method.
    fn find(&self, method: &Method, path: &str) -> Option<Result<EngineRoute, &'static str>> {
        if let Some(at) = ENGINE_ROUTES.iter().position(|spec| spec.path == path) {
            if !self.table[at] {
                return None;
            }
            let spec = &ENGINE_ROUTES[at];
            return Some(if method.as_str() == spec.method {
                Ok(EngineRoute(at as u8))
            } else {
                Err(spec.method)
            });
        }
        let served = matches!(*method, Method::GET | Method::POST);
        self.configured.contains(path).then_some(if served {
            Ok(EngineRoute(CONFIGURED))
        } else {
            Err("GET, POST")
        })
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

/// Matches a method and path (without query) against kvmesh's routes, then `engines`'.
pub(crate) fn match_route(engines: &EngineRoutes, method: &Method, path: &str) -> RouteMatch {
    let (route, allowed, allow) = match path {
        "/v1/chat/completions" => (Route::ChatCompletions, Method::POST, "POST"),
        "/v1/completions" => (Route::Completions, Method::POST, "POST"),
        "/v1/embeddings" => (Route::Embeddings, Method::POST, "POST"),
        "/v1/responses" => (Route::Responses, Method::POST, "POST"),
        "/v1/models" => (Route::Models, Method::GET, "GET"),
        "/openapi.json" => (Route::OpenApi, Method::GET, "GET"),
        "/docs" => (Route::Docs, Method::GET, "GET"),
        _ => {
            return match engines.find(method, path) {
                Some(Ok(route)) => RouteMatch::Found(Route::Engine(route)),
                Some(Err(allow)) => RouteMatch::MethodNotAllowed(allow),
                None => RouteMatch::NotFound,
            };
        }
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
        let engines = EngineRoutes::new(&EngineRoutesConfig::default());
        assert_eq!(
            match_route(&engines, &Method::POST, "/v1/chat/completions"),
            RouteMatch::Found(Route::ChatCompletions)
        );
        assert_eq!(
            match_route(&engines, &Method::POST, "/v1/embeddings"),
            RouteMatch::Found(Route::Embeddings)
        );
        assert_eq!(
            match_route(&engines, &Method::GET, "/v1/models"),
            RouteMatch::Found(Route::Models)
        );
        assert_eq!(
            match_route(&engines, &Method::GET, "/v1/completions"),
            RouteMatch::MethodNotAllowed("POST")
        );
        assert_eq!(
            match_route(&engines, &Method::POST, "/v1/models"),
            RouteMatch::MethodNotAllowed("GET")
        );
        assert_eq!(
            match_route(&engines, &Method::GET, "/v2/x"),
            RouteMatch::NotFound
        );
        assert_eq!(
            match_route(&engines, &Method::POST, "/v1/chat/completions/"),
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

    #[test]
    fn engine_routes_match_by_the_config() {
        let defaults = EngineRoutes::new(&EngineRoutesConfig::default());
        let RouteMatch::Found(tokenize) = match_route(&defaults, &Method::POST, "/tokenize") else {
            panic!("/tokenize is forwarded by default");
        };
        assert_eq!(tokenize.label(), "/tokenize");
        assert_eq!(tokenize.prompt_kind(), PromptKind::Tokenize);
        assert_eq!(
            match_route(&defaults, &Method::GET, "/tokenize"),
            RouteMatch::MethodNotAllowed("POST")
        );
        let RouteMatch::Found(Route::Engine(reset)) =
            match_route(&defaults, &Method::POST, "/reset_prefix_cache")
        else {
            panic!("admin routes match, for keys that may use them");
        };
        assert!(reset.is_admin());
        assert_eq!(
            match_route(&defaults, &Method::POST, "/my/route"),
            RouteMatch::NotFound
        );

        let only = EngineRoutes::new(&EngineRoutesConfig {
            forward: vec!["/v1/rerank".into(), "/my/route".into()],
        });
        assert_eq!(
            match_route(&only, &Method::POST, "/tokenize"),
            RouteMatch::NotFound
        );
        let RouteMatch::Found(mine) = match_route(&only, &Method::GET, "/my/route") else {
            panic!("a configured path is forwarded");
        };
        assert_eq!(mine.label(), "other");
        assert_eq!(mine.index(), ROUTE_COUNT - 1);
        assert!(matches!(
            match_route(&only, &Method::POST, "/v1/rerank"),
            RouteMatch::Found(Route::Engine(_))
        ));
    }
}
