/**
 * The parts that the dialogs of reports share (a rewind's, a fallback restore's): a titled
 * list, a name with the reason it did not come back, and the dialog itself.
 */

import { Dialog, showDialog } from '@jupyterlab/apputils';
import type { TranslationBundle } from '@jupyterlab/translation';
import * as React from 'react';
import { untranslated } from './translation';

/** One part of a report: its title over the items it lists; nothing when there are none. */
export function ReportSection(props: {
  section: string;
  title: string;
  items: readonly React.ReactNode[];
}): JSX.Element | null {
  if (props.items.length === 0) {
    return null;
  }
  return (
    <section data-section={props.section}>
      <h3>{props.title}</h3>
      <ul>{props.items}</ul>
    </section>
  );
}

/** The items of a list of names, each with the reason it did not come back. */
export function namedReasons(
  items: readonly { name: string; reason: string }[]
): JSX.Element[] {
  return items.map(item => (
    <li key={item.name} data-name={item.name}>
      <code>{item.name}</code>
      {`: ${item.reason}`}
    </li>
  ));
}

/** The items of a list of plain lines. */
export function lines(texts: readonly string[]): JSX.Element[] {
  return texts.map((text, at) => <li key={at}>{text}</li>);
}

/** Shows a report in a dialog with one Close button; resolves once closed. */
export async function showReport(
  title: string,
  body: JSX.Element,
  trans: TranslationBundle = untranslated
): Promise<void> {
  await showDialog({
    title,
    body,
    buttons: [Dialog.okButton({ label: trans.__('Close') })]
  });
}
