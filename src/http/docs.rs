//! `GET /openapi.yaml`, the browsable docs at `GET /docs`, and `GET /`, which
//! leads there. Everything is built into the binary (the spec with
//! `include_str!`, Swagger UI vendored from npm's swagger-ui-dist under
//! `assets/swagger-ui/`), so the docs work offline and nothing is fetched at
//! build or run time.

use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Redirect, Response};

use super::error::ApiError;
use super::extract::PathParam;

/// The API description at the repository root, exactly as served.
pub const OPENAPI_YAML: &str = include_str!("../../openapi.yaml");

const DOCS_PAGE: &str = include_str!("../../assets/docs/index.html");

/// The page may load only what this server serves; inline styles are
/// allowed because Swagger UI sets them on its elements.
const DOCS_CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; \
     img-src 'self' data:; font-src 'self' data:; connect-src 'self'; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

/// How long a browser may reuse an asset without asking. Short, because the
/// names carry no version: a redeploy is seen within the hour.
const ASSET_CACHE_CONTROL: &str = "public, max-age=3600";

struct Asset {
    name: &'static str,
    content_type: &'static str,
    body: &'static [u8],
}

/// The files `/docs/{asset}` serves; `openapi.yaml`'s enum of `asset`
/// lists the same names.
const ASSETS: &[Asset] = &[
    Asset {
        name: "swagger-ui-bundle.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../../assets/swagger-ui/swagger-ui-bundle.js"),
    },
    Asset {
        name: "swagger-ui.css",
        content_type: "text/css; charset=utf-8",
        body: include_bytes!("../../assets/swagger-ui/swagger-ui.css"),
    },
    Asset {
        name: "init.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../../assets/docs/init.js"),
    },
];

pub async fn openapi() -> Response {
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/yaml"),
            ),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            (
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
        ],
        OPENAPI_YAML,
    )
        .into_response()
}

pub async fn page() -> Response {
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/html; charset=utf-8"),
            ),
            (
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(DOCS_CSP),
            ),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            (
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
        ],
        DOCS_PAGE,
    )
        .into_response()
}

/// Someone opening the server's bare address wants the docs. Temporary
/// (307) rather than permanent, so browsers do not cache it and `/` stays
/// free for something else later; relative, so it holds on any host.
pub async fn root() -> Redirect {
    Redirect::temporary("/docs")
}

pub async fn asset(PathParam(name): PathParam) -> Result<Response, ApiError> {
    let asset = ASSETS
        .iter()
        .find(|a| a.name == name)
        .ok_or(ApiError::NotFound)?;
    Ok((
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static(asset.content_type),
            ),
            (
                header::CACHE_CONTROL,
                HeaderValue::from_static(ASSET_CACHE_CONTROL),
            ),
            (
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
        ],
        asset.body,
    )
        .into_response())
}

/// The names `/docs/{asset}` serves, for tests that compare them with the spec.
pub fn asset_names() -> impl Iterator<Item = &'static str> {
    ASSETS.iter().map(|a| a.name)
}
