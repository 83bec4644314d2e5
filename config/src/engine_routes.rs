//! `engine_routes`: the engines' own routes the data listener forwards as they are (vLLM's
//! `/tokenize`, `/v1/rerank`, `/v1/audio/transcriptions`, SGLang's `/generate`, …), beside
//! the OpenAI routes kvmesh interprets. [`ENGINE_ROUTES`] lists what vLLM 0.32 serves and
//! SGLang's native routes; the inference routes are forwarded by default, the admin and
//! development routes only for API keys with `engine_admin: true`.

use serde::Deserialize;

use crate::FieldPath;
use crate::violation::{Checked, fail};

/// Who may use an engine route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineAccess {
    /// An inference route: forwarded when `engine_routes.forward` lists it (by default).
    Inference,
    /// An admin or development route (cache resets, sleep, weights, profiling, adapters):
    /// forwarded only for an API key with `engine_admin: true`.
    Admin,
}

/// One route an engine serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineRouteSpec {
    /// The path (exact, without query).
    pub path: &'static str,
    /// The method the engine serves it with (`GET` or `POST`).
    pub method: &'static str,
    /// Who may use it.
    pub access: EngineAccess,
}

const fn inference(path: &'static str, method: &'static str) -> EngineRouteSpec {
    EngineRouteSpec {
        path,
        method,
        access: EngineAccess::Inference,
    }
}

const fn admin(path: &'static str, method: &'static str) -> EngineRouteSpec {
    EngineRouteSpec {
        path,
        method,
        access: EngineAccess::Admin,
    }
}

/// The routes of vLLM 0.32's API server besides the ones kvmesh serves itself
/// ([`KVMESH_ROUTES`]) and its probes (`/health`, `/load`, `/metrics`, `/version`, `/ping`),
/// which kvmesh answers on its admin listener instead; then SGLang's native ones.
pub const ENGINE_ROUTES: [EngineRouteSpec; 58] = [
    inference("/tokenize", "POST"),
    inference("/detokenize", "POST"),
    inference("/tokenizer_info", "GET"),
    inference("/inference/v1/generate", "POST"),
    inference("/v1/chat/completions/render", "POST"),
    inference("/v1/completions/render", "POST"),
    inference("/v1/responses/render", "POST"),
    inference("/v1/chat/completions/derender", "POST"),
    inference("/v1/completions/derender", "POST"),
    inference("/v1/chat/completions/batch", "POST"),
    inference("/v1/messages", "POST"),
    inference("/v1/messages/count_tokens", "POST"),
    inference("/v1/messages/render", "POST"),
    inference("/cohere/v2/chat", "POST"),
    inference("/pooling", "POST"),
    inference("/classify", "POST"),
    inference("/score", "POST"),
    inference("/v1/score", "POST"),
    inference("/generative_scoring", "POST"),
    inference("/rerank", "POST"),
    inference("/v1/rerank", "POST"),
    inference("/v2/rerank", "POST"),
    inference("/v2/embed", "POST"),
    inference("/v1/audio/transcriptions", "POST"),
    inference("/v1/audio/translations", "POST"),
    inference("/invocations", "POST"),
    admin("/reset_prefix_cache", "POST"),
    admin("/reset_mm_cache", "POST"),
    admin("/reset_encoder_cache", "POST"),
    admin("/sleep", "POST"),
    admin("/wake_up", "POST"),
    admin("/is_sleeping", "GET"),
    admin("/pause", "POST"),
    admin("/resume", "POST"),
    admin("/is_paused", "GET"),
    admin("/collective_rpc", "POST"),
    admin("/v1/load_lora_adapter", "POST"),
    admin("/v1/unload_lora_adapter", "POST"),
    admin("/start_profile", "POST"),
    admin("/stop_profile", "POST"),
    admin("/scale_elastic_ep", "POST"),
    admin("/is_scaling_elastic_ep", "POST"),
    admin("/update_weights", "POST"),
    admin("/start_weight_update", "POST"),
    admin("/finish_weight_update", "POST"),
    admin("/start_draft_weight_update", "POST"),
    admin("/update_weight_version", "POST"),
    admin("/init_weight_transfer_engine", "POST"),
    admin("/shutdown_weight_transfer_engine", "POST"),
    admin("/weight_checker", "POST"),
    admin("/weight_info", "GET"),
    admin("/release_kv_cache_memory", "POST"),
    admin("/abort_requests", "POST"),
    admin("/server_info", "GET"),
    inference("/generate", "POST"),
    inference("/encode", "POST"),
    admin("/flush_cache", "POST"),
    admin("/get_server_info", "GET"),
];

/// The data listener's own routes: never forwarded as engine routes.
pub const KVMESH_ROUTES: [&str; 7] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/models",
    "/openapi.json",
    "/docs",
];

/// The known route at `path`, if any.
pub fn engine_route(path: &str) -> Option<&'static EngineRouteSpec> {
    ENGINE_ROUTES.iter().find(|spec| spec.path == path)
}

/// `engine_routes`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineRoutesConfig {
    /// Inference routes forwarded to an instance of the request's model: paths of
    /// [`ENGINE_ROUTES`] (with their method) or other paths (`GET` and `POST`). Default:
    /// every inference route of [`ENGINE_ROUTES`]; `[]` forwards none.
    pub forward: Vec<String>,
}

impl Default for EngineRoutesConfig {
    fn default() -> Self {
        Self {
            forward: ENGINE_ROUTES
                .iter()
                .filter(|spec| spec.access == EngineAccess::Inference)
                .map(|spec| spec.path.to_string())
                .collect(),
        }
    }
}

/// Checks `engine_routes`; `path` is `engine_routes`.
pub(crate) fn check_engine_routes(routes: &EngineRoutesConfig, path: &FieldPath) -> Checked {
    let forward = path.key("forward");
    for (i, route) in routes.forward.iter().enumerate() {
        let at = forward.index(i);
        if !route.starts_with('/') || route.contains(['?', '#', ' ']) {
            return fail(at, format!("{route:?} must be a path: '/' first, no query"));
        }
        if KVMESH_ROUTES.contains(&route.as_str()) {
            return fail(
                at,
                format!("{route} is served by kvmesh itself, not forwarded as it is"),
            );
        }
        if engine_route(route).is_some_and(|spec| spec.access == EngineAccess::Admin) {
            return fail(
                at,
                format!(
                    "{route} is an engine admin route: it is forwarded only for API keys with \
                     engine_admin: true"
                ),
            );
        }
        if let Some(first) = routes.forward[..i].iter().position(|r| r == route) {
            return fail(
                at,
                format!("{route} is listed twice (also engine_routes.forward[{first}])"),
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_has_each_path_once_and_none_of_kvmesh_s_own() {
        for (i, spec) in ENGINE_ROUTES.iter().enumerate() {
            assert!(
                ENGINE_ROUTES[..i]
                    .iter()
                    .all(|other| other.path != spec.path),
                "{} twice",
                spec.path
            );
            assert!(!KVMESH_ROUTES.contains(&spec.path), "{}", spec.path);
            assert!(matches!(spec.method, "GET" | "POST"), "{}", spec.path);
        }
    }

    #[test]
    fn the_default_forwards_every_inference_route_and_no_admin_route() {
        let forward = EngineRoutesConfig::default().forward;
        assert!(forward.contains(&"/tokenize".to_string()));
        assert!(forward.contains(&"/v1/audio/transcriptions".to_string()));
        assert!(!forward.contains(&"/reset_prefix_cache".to_string()));
        assert_eq!(
            check_engine_routes(&EngineRoutesConfig::default(), &FieldPath::root()),
            Ok(())
        );
    }
}
