"""The request path: each endpoint kind's ordered stages (`stages`), run over one `RequestContext` by one runner
(`runner`): read -> route -> parse -> prepare -> execute -> record -> respond. The other modules are what the
stages call: `parse` (the read and parse stages' body checks), `prepare` (template and tokens), `execute`
(one Generate call read as deltas), `stream` and `respond` (the API's shapes)."""
