/**
 * The notifications on JupyterLab's manager as a test reads them, and a click on their
 * actions. Apart from the fixtures: a spec that uses these mocks '@jupyterlab/apputils' down
 * to the real notification manager, which the specs without notifications need not load.
 */
import { Notification } from '@jupyterlab/apputils';

/** The notifications on screen: message, type, how they close, and their actions. */
export function shown() {
  return Notification.manager.notifications.map(n => ({
    message: n.message,
    type: n.type,
    autoClose: n.options.autoClose,
    actions: (n.options.actions ?? []).map(a => a.label)
  }));
}

/** Clicks an action of the (only) notification that has it. */
export function click(label: string): void {
  const action = Notification.manager.notifications
    .flatMap(n => n.options.actions ?? [])
    .find(a => a.label === label);
  if (!action) {
    throw new Error(`no notification offers '${label}'`);
  }
  action.callback(new MouseEvent('click'));
}
