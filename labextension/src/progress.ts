/**
 * The notification that follows a save or a restore.
 *
 * Progress changes it in place; the outcome replaces it with a new notification.
 * JupyterLab hands an update to the toast only once the toast is on screen, so an
 * outcome that came first (a refusal within milliseconds) or right after a progress
 * update was lost: the toast stayed at its progress text and never closed by itself.
 */
import { Notification } from '@jupyterlab/apputils';

export class JobNotification {
  constructor(message: string) {
    this._id = Notification.emit(message, 'in-progress', { autoClose: false });
  }

  /** The job's phase and, once known, how far it is. */
  progress(message: string, progress?: number): void {
    Notification.update({
      id: this._id,
      type: 'in-progress',
      message,
      progress,
      autoClose: false
    });
  }

  /**
   * Show the outcome. ``actions`` receives the function that closes the outcome's
   * notification, for an action that must close it (Details keeps it open).
   */
  finish(
    type: 'success' | 'error',
    message: string,
    options: {
      autoClose: number | false;
      actions?: (dismiss: () => void) => Notification.IAction[];
    }
  ): void {
    Notification.dismiss(this._id);
    const dismiss = () => Notification.dismiss(this._id);
    this._id = Notification.emit(message, type, {
      autoClose: options.autoClose,
      actions: options.actions?.(dismiss)
    });
  }

  private _id: string;
}
