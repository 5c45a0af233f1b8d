/**
 * Asking for a snapshot's name (Snapshot Kernel As…, a rename in the sidebar) with the
 * store's rules checked as the user types: the dialog's Snapshot or Rename button stays
 * disabled while the name is invalid or taken, and a line under the field says why. A
 * name refused after the dialog closed would show far from where it was typed.
 *
 * The rules are the store's (core/store/snapshot.py, validate_name): 1-64 letters, digits, '.',
 * '_' or '-', starting with a letter or digit, not ending in '.' or '-', no '..'; and no
 * other snapshot may have it. They are the field's HTML pattern, which JupyterLab's
 * dialog checks on every keystroke (an :invalid field disables its accepting buttons).
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import type { TranslationBundle } from '@jupyterlab/translation';
import { Widget } from '@lumino/widgets';
import { untranslated } from './translation';

/** A name's characters, as the store's NAME_PATTERN and validate_name take them. */
const NAME_RULE = '(?!.*\\.\\.)[A-Za-z0-9][A-Za-z0-9._\\-]{0,63}(?<![.\\-])';

/**
 * The field's pattern: a valid name that is none of ``taken``. Written for the browser's
 * 'v' flag (a '-' in a class is escaped, '.' of a name outside one).
 */
export function namePattern(taken: Iterable<string> = []): string {
  const others = [...taken]
    .filter(name => new RegExp(`^(?:${NAME_RULE})$`, 'u').test(name))
    .map(name => name.replace(/\./g, '\\.'));
  return others.length ? `(?!(?:${others.join('|')})$)${NAME_RULE}` : NAME_RULE;
}

/** Whether ``name`` is a name the store takes and none of ``taken``. */
export function isFreeName(name: string, taken: Iterable<string> = []): boolean {
  return new RegExp(`^(?:${namePattern(taken)})$`, 'u').test(name);
}

/** The body of the naming dialog: the field, its rule, and why the name is refused. */
class NameField extends Widget {
  constructor(
    label: string,
    text: string,
    placeholder: string,
    private readonly _taken: Set<string>,
    private readonly _trans: TranslationBundle
  ) {
    super();
    this.addClass('jp-gpu-snapshot-name-field');
    const caption = document.createElement('label');
    caption.textContent = label;
    this._input.className = 'jp-mod-styled jp-gpu-snapshot-name-input';
    this._input.value = text;
    this._input.placeholder = placeholder;
    this._input.required = true;
    this._input.pattern = namePattern(_taken);
    this._input.spellcheck = false;
    this._input.setAttribute('aria-describedby', 'jp-gpu-snapshot-name-why');
    this._why.id = 'jp-gpu-snapshot-name-why';
    this._why.className = 'jp-gpu-snapshot-name-why';
    this._why.setAttribute('role', 'status');
    caption.appendChild(this._input);
    this.node.append(caption, this._why);
    this._input.addEventListener('input', () => this._explain());
    this._explain();
  }

  getValue(): string {
    return this._input.value.trim();
  }

  /** Once in the dialog: the dialog checks the name as it stands (it does on input). */
  protected onAfterAttach(): void {
    requestAnimationFrame(() =>
      this._input.dispatchEvent(new Event('input', { bubbles: true }))
    );
  }

  private _explain(): void {
    const name = this._input.value.trim();
    const trans = this._trans;
    this._why.textContent = !name
      ? ''
      : this._taken.has(name)
        ? trans.__("Another snapshot is named '%1'.", name)
        : isFreeName(name)
          ? ''
          : trans.__(
              "Use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit, not ending in '.' or '-'."
            );
  }

  private readonly _input = document.createElement('input');
  private readonly _why = document.createElement('div');
}

export interface INameAnswer {
  name: string;
  /** The dialog's checkbox, when it had one. */
  checked: boolean | null;
}

/**
 * Asks for a snapshot name that is valid and none of ``taken``; resolves with it, or
 * null on Cancel (or when ``text`` is accepted unchanged, for a rename).
 */
export async function askSnapshotName(options: {
  title: string;
  okLabel: string;
  text?: string;
  placeholder?: string;
  taken?: Iterable<string>;
  checkbox?: Partial<Dialog.ICheckbox>;
  trans?: TranslationBundle;
}): Promise<INameAnswer | null> {
  const trans = options.trans ?? untranslated;
  const field = new NameField(
    trans.__('Name'),
    options.text ?? '',
    options.placeholder ?? '',
    new Set(options.taken ?? []),
    trans
  );
  const result = await showDialog({
    title: options.title,
    body: field,
    focusNodeSelector: 'input',
    checkbox: options.checkbox ?? null,
    buttons: [Dialog.cancelButton(), Dialog.okButton({ label: options.okLabel })]
  });
  const name = result.value ?? '';
  if (!result.button.accept || !name || name === options.text) {
    return null;
  }
  return { name, checked: result.isChecked };
}
