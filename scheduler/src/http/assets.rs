//! The dashboard's static files, compiled into the binary: a cluster is often offline, so
//! nothing is fetched from anywhere else.

use actix_web::http::header::{CACHE_CONTROL, CONTENT_SECURITY_POLICY};
use actix_web::{HttpResponse, web};

const INDEX_HTML: &str = include_str!("assets/index.html");
const APP_JS: &str = include_str!("assets/app.js");
const STYLE_CSS: &str = include_str!("assets/style.css");

/// Only this origin's own files and API; no inline scripts.
const POLICY: &str = "default-src 'self'; img-src 'self' data:; style-src 'self'; \
                      script-src 'self'; connect-src 'self'; frame-ancestors 'none'";

pub(crate) fn routes(config: &mut web::ServiceConfig) {
    config
        .route(
            "/",
            web::get().to(|| asset(INDEX_HTML, "text/html; charset=utf-8")),
        )
        .route(
            "/assets/app.js",
            web::get().to(|| asset(APP_JS, "text/javascript; charset=utf-8")),
        )
        .route(
            "/assets/style.css",
            web::get().to(|| asset(STYLE_CSS, "text/css; charset=utf-8")),
        );
}

async fn asset(body: &'static str, content_type: &'static str) -> HttpResponse {
    HttpResponse::Ok()
        .content_type(content_type)
        .insert_header((CONTENT_SECURITY_POLICY, POLICY))
        .insert_header((CACHE_CONTROL, "no-cache"))
        .body(body)
}
