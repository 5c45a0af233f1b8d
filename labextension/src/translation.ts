/**
 * The extension's translation domain and its English default.
 *
 * A module of its own, below every other: the API client and the formatters both need an
 * untranslated bundle, and neither may import the other for it.
 */
import { nullTranslator, TranslationBundle } from '@jupyterlab/translation';

/** The extension's translation domain (its Python package's name). */
export const TRANSLATION_DOMAIN = 'jupyter_gpu_snapshot';

/** English as written in the source: the default wherever no translator is given. */
export const untranslated: TranslationBundle = nullTranslator.load(TRANSLATION_DOMAIN);
