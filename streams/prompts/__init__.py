"""Pipeline definitions: YAML files -> typed pipelines with versioned prompt templates."""

from streams.prompts.registry import Pipeline, PipelineRegistry, PipelineVersion, RenderedPrompt

__all__ = ["Pipeline", "PipelineRegistry", "PipelineVersion", "RenderedPrompt"]
