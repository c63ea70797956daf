// Renders the API description served by this same server. Its URL stays
// relative: Swagger UI resolves the spec's relative server (`/`) against it,
// so "Try it out" calls the host and port this page was opened from, the
// one origin its Content-Security-Policy allows. The validator badge is off
// because it would send the document to validator.swagger.io; the policy
// forbids every other origin anyway.
window.addEventListener("load", function () {
  window.ui = SwaggerUIBundle({
    url: "/openapi.yaml",
    dom_id: "#swagger-ui",
    deepLinking: true,
    validatorUrl: null,
    tryItOutEnabled: false,
    persistAuthorization: false,
    presets: [SwaggerUIBundle.presets.apis],
    layout: "BaseLayout",
  });
});
