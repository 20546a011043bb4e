"""Pipeline definitions: YAML files -> typed pipelines with versioned prompt templates,
slot cleaning and PII redaction, output checks and schema defaults, parameter guards."""
